"""A job's configuration, torch-free: every option declared once (`options.py`, with `ConfigError`),
where a path option is looked for and the rules every path passes (`paths.py`), and the TOML and
command-line reader (`parser.py`). The rules between options that need the models and the parallel
layout are torchtitan/config_rules.py's, which stands on both (docs/architecture.md's layers)."""
