"""Small helpers SMP v1 scripts import from ``smdistributed.modelparallel.torch.utils``: `rmsg`."""

from __future__ import annotations

import smp.state as smp_state

__all__ = ["rmsg"]


def rmsg(msg: object) -> str:
    """``msg`` prefixed with this process's global rank, as SMP v1 wrote its log lines.

    Before ``smp.init`` the rank is not known yet and the prefix says so (``[?]``), so a log line
    never raises.

    Example:
        >>> import smp.torch as smp
        >>> from smp.torch.utils import rmsg
        >>> smp.init({})
        >>> rmsg("step 10 done")
        '[0] step 10 done'
    """
    st = smp_state.current()
    rank = str(st.rank) if st.initialized else "?"
    return f"[{rank}] {msg}"
