"""Qwen3.5 and Qwen3-Next: the Gated DeltaNet hybrid (issue 65, in progress). So far its delta rule
(delta_rule.py); the family's arguments, flavours and model come next."""
