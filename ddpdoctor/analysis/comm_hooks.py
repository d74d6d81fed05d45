"""What the logs say of a DDP group's comm hook: its name, and the kinds that change what the
other checks may expect (compressing hooks, local SGD)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the runtime imports the replica check from here: no reading side at run time)
    from ddpdoctor.runlog import RankLog

#: Words in a hook's name that say it compresses the gradients it all-reduces.
COMPRESSING = ("compress", "powersgd", "quantiz")
#: Words in a hook's name that say the replicas train apart between model averagings (torch's
#: ``post_localSGD_hook``: after its start iteration it all-reduces within subgroups only).
LOCAL_SGD = ("localsgd",)


def comm_hook_name(logs: Iterable[RankLog]) -> str:
    """The comm hook in effect at the end of the logs (the user's, as the last layout names it,
    else the header's option); "" for DDP's own all-reduce."""
    name = ""
    for log in logs:
        if not name and log.header is not None:
            name = str(log.header.ddp_options.get("comm_hook") or "")
        if log.layouts and log.layouts[-1].comm_hook:
            name = log.layouts[-1].comm_hook
    return name


def compressing(name: str) -> bool:
    """Whether a hook of this name compresses the gradients it all-reduces."""
    return any(word in name.lower() for word in COMPRESSING)


def local_sgd(name: str) -> bool:
    """Whether a hook of this name lets the replicas train apart between model averagings."""
    return any(word in name.lower() for word in LOCAL_SGD)
