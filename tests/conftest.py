"""Keep tests offline and out of the home folder; subprocesses inherit these variables."""

import os
import tempfile

_home = tempfile.mkdtemp(prefix="titan-tests-home-")
os.environ["WANDB_MODE"] = "disabled"
os.environ["WANDB_DIR"] = _home
os.environ["HF_HOME"] = os.path.join(_home, "hf")
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TIKTOKEN_CACHE_DIR"] = ""
