"""The FLOPs profile DeepSpeed's ``flops_profiler`` section prints, made from a :class:`~dsfunc.monitor.flops.FlopCount`.

A summary (parameters, forward MACs and FLOPs of one micro-batch, the backward's FLOPs as counted, latencies
and FLOP/s where measured), the modules ranked by parameters and MACs at each depth (``top_modules``), and with
``detailed`` a table of every module to ``module_depth``. Numbers are written as DeepSpeed writes them
(``1.23 G``, ``615 MMACs``, ``12.5 ms``). MACs are half the FLOPs: what ``torch.utils.flop_counter`` counts
(matrix products, convolutions, attention) is multiply-adds.
"""

from __future__ import annotations

from collections.abc import Mapping

from dsfunc.monitor.flops import FlopCount

_UNITS = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"))
_LINE = "{:<64}{}"


def number_to_string(num: float, units: str | None = None, precision: int = 2) -> str:
    """``1.23 G``: the number in the largest of T, G, M, K (or m, u below 1) that keeps it at least 1."""
    scales = {u: s for s, u in _UNITS} | {"": 1.0, "m": 1e-3, "u": 1e-6}
    if units is None:
        units = next((u for s, u in _UNITS if num >= s), "")
        if units == "" and 0 < num < 1:
            units = "m" if num >= 1e-3 else "u"
    return f"{round(num / scales[units], precision):g} {units}"


def macs_to_string(macs: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(flops, units, precision) + "FLOPS"


def params_to_string(params: float, units: str | None = None, precision: int = 2) -> str:
    """``1.2 M`` parameters (billions as ``B``)."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = 2) -> str:
    return number_to_string(seconds, units, precision) + "s"


def _depth(path: str) -> int:
    return 0 if path == "" else path.count(".") + 1


def profile_text(
    count: FlopCount,
    *,
    step: int,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
    world_size: int = 1,
    micro_batches: int = 1,
    recompute_fwd_factor: float = 0.0,
    latency: Mapping[str, float] | None = None,
    counted: str = "once on a meta copy of the model, for one micro-batch",
    module_latency: Mapping[str, float] | None = None,
) -> str:
    """The profile as printable text.

    Args:
      count: one micro-batch's FLOPs (per data-parallel rank).
      step: the step it describes (for the heading).
      module_depth, top_modules, detailed: as DeepSpeed's keys (-1: every depth).
      world_size: data-parallel ranks.
      micro_batches: micro-batches per rank in one optimizer step.
      recompute_fwd_factor: forwards recomputed in the backward, added to the FLOPs the FLOP/s count.
      counted: how the FLOPs were counted (for the heading).
      module_latency: seconds of each module's forward (mean over the step's forwards), by module path.
      latency: seconds of one optimizer step, by ``"forward"``, ``"backward"``, ``"step"`` (the update) and
        ``"iter"`` (the whole step).
    """
    latency = dict(latency or {})
    module_latency = module_latency or {}
    if "forward" not in latency and "" in module_latency:
        latency["forward"] = module_latency[""] * micro_batches
    params, macs = count.params.get("", 0), count.forward / 2
    work = count.forward * (1 + recompute_fwd_factor) + count.backward
    lines = [
        "", "-------------------------- dsfunc FLOPs profiler (torch.utils.flop_counter) --------------------------",
        f"Profile Summary at step {step}:",
        f"FLOPs counted {counted} (torch.utils.flop_counter); MACs are half the FLOPs.",
        _LINE.format("world size (data parallel): ", world_size),
        _LINE.format("params of model: ", params_to_string(params)),
        _LINE.format("fwd MACs per rank: ", macs_to_string(macs)),
        _LINE.format("fwd flops per rank: ", number_to_string(count.forward)),
    ]
    if count.backward:
        lines += [
            _LINE.format("batch size per rank (one micro-batch): ", count.samples),
            _LINE.format("bwd flops per rank (counted): ", number_to_string(count.backward)),
            _LINE.format(f"fwd+bwd flops per rank (+ {recompute_fwd_factor:g} x fwd recomputed): ",
                         number_to_string(work)),
        ]
    for key, name in (("forward", "fwd latency"), ("backward", "bwd latency"), ("step", "step latency")):
        if key in latency:
            lines.append(_LINE.format(f"{name}: ", duration_to_string(latency[key])))
    if latency.get("iter"):
        per_rank = work * micro_batches / latency["iter"]
        lines += [
            _LINE.format("iter latency (the whole optimizer step): ", duration_to_string(latency["iter"])),
            _LINE.format(f"FLOPS per rank = fwd+bwd flops x {micro_batches} micro-batch(es) / iter latency: ",
                         flops_to_string(per_rank)),
            _LINE.format("samples/second: ",
                         f"{count.samples * micro_batches * world_size / latency['iter']:.2f}"),
        ]
    lines += ["", *_ranking(count, module_depth, top_modules, module_latency)]
    if detailed:
        lines += ["", *_table(count, module_depth, module_latency)]
    lines.append("-" * 104)
    return "\n".join(lines)


def _ranking(count: FlopCount, module_depth: int, top_modules: int, module_latency: Mapping[str, float]) -> list[str]:
    """The top modules by parameters, by MACs (and by fwd latency) at each depth, summed over the modules of one
    class."""
    by_depth: dict[int, dict[str, list[float]]] = {}
    for path, kind in count.kinds.items():
        totals = by_depth.setdefault(_depth(path), {}).setdefault(kind, [0, 0, 0])
        totals[0] += count.params.get(path, 0)
        totals[1] += count.modules.get(path, 0) / 2
        totals[2] += module_latency.get(path, 0)
    depths = sorted(by_depth) if module_depth < 0 else [d for d in sorted(by_depth) if d <= module_depth]
    timed = " or fwd latency" if module_latency else ""
    lines = [f"Top {top_modules} modules in terms of params, MACs{timed} at each model depth:"]
    for d in depths:
        ranked = [sorted(by_depth[d].items(), key=lambda kv, i=i: kv[1][i], reverse=True)[:top_modules]
                  for i in (0, 1, 2)]
        lines += [f"depth {d}:",
                  f"    params      - { {k: params_to_string(v[0]) for k, v in ranked[0]} }",
                  f"    MACs        - { {k: macs_to_string(v[1]) for k, v in ranked[1]} }"]
        if module_latency:
            lines.append(f"    fwd latency - { {k: duration_to_string(v[2]) for k, v in ranked[2]} }")
    return lines


def _table(count: FlopCount, module_depth: int, module_latency: Mapping[str, float]) -> list[str]:
    """Each module to ``module_depth``: params, share of params, fwd MACs, share of MACs, fwd FLOPs (and fwd
    latency, its share and the FLOP/s)."""
    total_params, total_macs = count.params.get("", 0) or 1, count.forward / 2 or 1
    total_time = module_latency.get("", 0.0)
    timed = ", fwd latency, % of fwd latency, fwd FLOPS" if module_latency else ""
    lines = [f"Per module: params, % of params, fwd MACs, % of fwd MACs, fwd flops{timed} (one micro-batch per rank)"]
    for path, kind in count.kinds.items():
        depth = _depth(path)
        if 0 <= module_depth < depth:
            continue
        params, macs = count.params.get(path, 0), count.modules.get(path, 0) / 2
        name = "  " * depth + (f"{path.rsplit('.', 1)[-1]} ({kind})" if path else kind)
        row = (f"{name:<48} {params_to_string(params):>10} {100 * params / total_params:6.2f}% "
               f"{macs_to_string(macs):>14} {100 * macs / total_macs:6.2f}% {number_to_string(2 * macs).strip():>10}")
        if path in module_latency:
            t = module_latency[path]
            row += (f" {duration_to_string(t):>10} {100 * t / total_time if total_time else 0:6.2f}% "
                    f"{flops_to_string(2 * macs / t if t else 0):>14}")
        lines.append(row)
    return lines
