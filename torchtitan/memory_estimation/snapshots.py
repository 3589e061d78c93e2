"""MemTracker snapshots (memory kind -> bytes): their arithmetic, and the columns printed."""

Snapshot = dict[str, int]  # MemTracker's memory kinds (and "Total") -> bytes
Columns = dict[str, int]  # params, grads, optimizer, activations and peak -> bytes

# MemTracker's memory kinds (FSDPMemTracker's finer ones included) -> the columns printed.
# Gathered parameters and their all-gather buffers count as parameters, reduce-scatter buffers as
# gradients, and the backward pass's temporaries (gradients of activations) as activations.
COLUMNS = {
    "Parameter": "params",
    "Sharded Param": "params",
    "Unsharded Param": "params",
    "All Gather": "params",
    "Buffer": "params",
    "Gradient": "grads",
    "Sharded Grad": "grads",
    "Unsharded Grad": "grads",
    "Reduce Scatter": "grads",
    "Optstate": "optimizer",
    "OptState": "optimizer",
    "Activation": "activations",
    "Temp": "activations",
    "Inputs": "activations",
    "Other": "activations",
}


def to_columns(snapshot: dict) -> Columns:
    columns = dict.fromkeys(["params", "grads", "optimizer", "activations"], 0)
    for kind, nbytes in snapshot.items():
        name = getattr(kind, "value", kind)  # MemTracker's kinds are str enums
        if name != "Total":
            columns[COLUMNS.get(name, "activations")] += nbytes
    columns["peak"] = snapshot["Total"]
    return columns


def plus(a: Snapshot, b: Snapshot) -> Snapshot:
    return {k: a.get(k, 0) + b.get(k, 0) for k in a.keys() | b.keys()}


def minus(a: Snapshot, b: Snapshot) -> Snapshot:
    return {k: a.get(k, 0) - b.get(k, 0) for k in a.keys() | b.keys()}


def highest(*snapshots: Snapshot) -> Snapshot:
    return max(snapshots, key=lambda snap: snap["Total"])
