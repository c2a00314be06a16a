"""JSON renderer: the versioned schema of ``json_schema``."""

from __future__ import annotations

import json
from typing import Any


def render_json(report_dict: dict[str, Any]) -> str:
    return json.dumps(report_dict, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
