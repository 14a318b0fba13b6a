"""Turn a domain module's ValueError into the AnsibleFilterError that Ansible reports as a task failure."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from ansible.errors import AnsibleFilterError


def as_filter(func: Callable[..., Any]) -> Callable[..., Any]:
    """Return func for a FilterModule map: its ValueError becomes AnsibleFilterError (same message)."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except ValueError as exc:
            raise AnsibleFilterError(str(exc)) from exc

    return wrapper
