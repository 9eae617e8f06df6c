"""A node's failure report: the rank that ended first, hung or was killed, its traceback once, then the rest.

The order is the exit clock's ([Note: which rank failed first] in :mod:`dsfunc.launcher.exits`). A rank
whose program had ended with code 0 has not failed, even when the agent's SIGTERM then ended its
shutdown; a rank that ended with code 0 while others still ran is named first, as having left early. The
ranks' shims leave their tracebacks to this report (:mod:`dsfunc.launcher.shim`), so each error is printed
once: the first failure's traceback, with every other rank that failed with the same error named beside
it, then one line for each other rank.
"""

from __future__ import annotations

import signal

from dsfunc.launcher.exits import RankState

_MESSAGE_CHARS = 300  # of another rank's error, on its one line


def first_failed(failures: dict, states: dict[int, RankState]) -> list[int]:
    """The failed ranks (``{global_rank: ProcessFailure}``), the one that failed first first.

    By when their processes ended when the clock saw every one of them (``states``, its
    :meth:`~dsfunc.launcher.exits.ExitClock.ranks`); else as torch elastic's agent orders
    them: by its timestamps, then in the order it noticed them (a rank it stopped itself comes after the ones
    that had failed). Ranks whose program had ended with code 0 come last either way, those the agent's
    SIGTERM stopped after those that died otherwise in their shutdown (a crash at exit). A rank dsfunc stopped as
    hung comes first: the ranks waiting for it fail because it is stopped, and on a loaded host its death may be
    seen after theirs.
    """
    ended = {r: states[r].ended if r in states else None for r in failures}
    noticed = list(failures)

    def finished(rank: int) -> tuple[bool, bool, bool]:
        hung = rank in states and states[rank].hung is not None  # dsfunc stopped it: the others' failures follow
        done = rank in states and states[rank].code == 0
        return not hung, done, done and failures[rank].exitcode == -signal.SIGTERM

    if all(t is not None for t in ended.values()):
        return sorted(failures, key=lambda r: (finished(r), ended[r], r))
    return sorted(failures, key=lambda r: (finished(r), failures[r].timestamp, noticed.index(r)))


def exit_code_of(failures: dict, rank: int, states: dict[int, RankState]) -> int:
    """The code ``rank`` failed with: the one its program exited with even when the agent's SIGTERM ended the
    process during the interpreter's shutdown, else its process's (128 + signal for a signal)."""
    code = failures[rank].exitcode
    said = states[rank].code if rank in states else None
    if code < 0 and said:
        return said
    return code if code > 0 else 128 + (-code or 1)


def _how(failure, state: RankState | None, why: bool = True) -> str:
    """How the rank ended; for a rank dsfunc stopped as hung, why (``why``) or a pointer to it."""
    said = state.code if state is not None else None
    if state is not None and state.hung is not None:
        return f"signal {failure.signal_name()}, stopped by dsfunc as hung" + (f": {state.hung}" if why else "")
    if failure.exitcode >= 0:
        return f"exit code {failure.exitcode}"
    if said:
        return f"exit code {said} (its shutdown then stopped by signal {failure.signal_name()})"
    if said == 0:
        return f"signal {failure.signal_name()}, after its program had ended with code 0"
    return f"signal {failure.signal_name()}"


def _trace(failure) -> str | None:
    message = failure.message
    if not isinstance(message, dict):
        return None
    return message.get("extraInfo", {}).get("py_callstack") or message.get("message") or None


def _error(failure) -> str | None:
    """The one-line error a rank's error file records (``Type: message``), or None."""
    message = failure.message
    return message.get("message") if isinstance(message, dict) else None


def _not_there(failed: int, states: dict[int, RankState], first_rank: int, host: str) -> list[str]:
    """When ``failed`` ended waiting in a collective (its process group's timeout, most often), the ranks of
    this node that were not in one, neither when asked for their stack during that wait nor at its end, and
    where they were ([Note: naming a hung rank] in :mod:`dsfunc.launcher.hangs`)."""
    state = states.get(failed)
    if state is None or state.waiting is None or state.hung is not None or state.ended is None:
        return []
    since, where = state.waiting
    lines = []
    for rank, other in sorted(states.items()):
        if other.waiting is not None or other.stack is None or not since < other.stack[0] < state.ended:
            continue
        lines.append(f"dsfunc: rank {rank} (local rank {rank - first_rank} on {host}) had not reached the "
                     f"collective rank {failed} waited in for {state.ended - since:.0f} s ({where}); "
                     f"{state.ended - other.stack[0]:.0f} s before that wait ended, it was at")
        lines += ["  " + line for line in other.stack[1].rstrip().splitlines()]
    return lines


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"


def failure_report(failures: dict, host: str, states: dict[int, RankState], first_rank: int = 0) -> str:
    """Human-readable report of failed ranks (``{global_rank: ProcessFailure}``) of the node ``host`` whose
    first global rank is ``first_rank``: the ranks that left early, the first failure with its traceback (or
    the stack a hung rank was stopped at), then the other failed ranks."""
    order = first_failed(failures, states)
    first = failures[order[0]]
    lines = []
    start = states[order[0]].ended if order[0] in states else None
    early = sorted((s.ended, r) for r, s in states.items()
                   if r not in failures and s.ended is not None and start is not None and s.ended < start)
    for _, rank in early:
        lines.append(f"dsfunc: rank {rank} (local rank {rank - first_rank} on {host}) exited with code 0 early, "
                     "before the others had finished (a rank that leaves breaks the collectives the others "
                     "wait for it in)")
    code = exit_code_of(failures, order[0], states)
    same = [r for r in order if _error(failures[r]) is not None and _error(failures[r]) == _error(first)
            and exit_code_of(failures, r, states) == code]
    then = "then " if early else ""
    if len(same) < 2:
        lines.append(f"dsfunc: rank {order[0]} (local rank {first.local_rank} on {host}) {then}failed with "
                     f"{_how(first, states.get(order[0]))}")
    else:
        lines.append(f"dsfunc: {_ranks(same)} (on {host}) {then}failed with exit code {code}, each with this "
                     f"error (rank {order[0]} first)")
    state = states.get(order[0])
    trace = _trace(first)
    if state is not None and state.hung is not None and state.stack is not None:
        lines[-1] += "; it was at"
        trace = state.stack[1]
    if trace is not None:
        lines += ["  " + line for line in trace.rstrip().splitlines()]
    else:
        lines.append("  (no Python traceback was recorded; see the rank's output above)")
    lines += _not_there(order[0], states, first_rank, host)
    for rank in order[1:]:
        if rank in same:
            continue
        f = failures[rank]
        error = _error(f)
        said = f": {error[:_MESSAGE_CHARS]}" if error else ""
        lines.append(f"dsfunc: rank {rank} (local rank {f.local_rank} on {host}) also stopped with "
                     f"{_how(f, states.get(rank), why=False)}{said}")
    return "\n".join(lines)
