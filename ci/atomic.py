"""Moved to `nsa_contract.atomic`. This name stays only for the lab scripts (lab/) that
import `from ci import atomic`; the packages import nsa_contract.atomic.
Delete this file once those scripts do too.
"""

from __future__ import annotations

from nsa_contract.atomic import replace_dir, staging_dir, write_bytes, write_text

__all__ = ["replace_dir", "staging_dir", "write_bytes", "write_text"]
