"""Reading a Triton Python model's ``config.pbtxt`` parameters, as upstream's templates read them.

Light (no torch): the embedded-engine models import it at the top of their ``model.py``. The
pre/postprocessing models keep their own copy, since they import nothing of trtmoe.
"""

from __future__ import annotations


def model_param(config: dict, key: str, default: str = "") -> str:
    """A parameter's string value; ``default`` when unset, empty or an unfilled ``${...}`` placeholder."""
    value = config.get("parameters", {}).get(key, {}).get("string_value", "")
    return default if not value or (value.startswith("$" + "{") and value.endswith("}")) else value


def model_flag(config: dict, key: str, default: bool) -> bool:
    """A true/false parameter (also 1/0, yes/no); ``default`` when unset or anything else."""
    value = model_param(config, key, "").strip().lower()
    return True if value in ("true", "1", "yes") else False if value in ("false", "0", "no") else default
