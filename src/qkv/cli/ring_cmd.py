"""``qkv ring``: ring attention on P local processes (torch.multiprocessing, gloo on 127.0.0.1), measured, and
with ``--check`` compared with one process (the logic lives in :mod:`qkv.distributed`)."""
from __future__ import annotations

import types

import json
import os

import click

from qkv.cli import UserError
from qkv.cli._app import cli
from qkv._checks import available_bytes as _available_bytes

#: Memory one rank takes before its arrays: Python, torch and the engine (about 224 MB after the imports).
RANK_BYTES = 250 * 2**20
#: Processes P at most: this many per core, and never fewer than MIN_NPROC_LIMIT (each process takes about
#: 1.6 s of CPU to start, so a thousand on a few cores would take minutes before the ring begins).
PER_CORE, MIN_NPROC_LIMIT = 8, 16
#: --timeout's range in seconds: below a second a busy machine's ordinary delays would end the run, not a hang; above the
#: whole run's deadline (qkv.distributed._launch.DEFAULT_DEADLINE) it would never be reached.
MIN_TIMEOUT, MAX_TIMEOUT = 1.0, 600.0


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f}" if x < 10 else f"{x * 1e3:.0f}"


def _bytes(b: float) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= f:
            return f"{b / f:.1f} {unit}"
    return f"{int(b)} B"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _check_memory(P: int, N: int, B: int, H: int, E: int, dtype: str, backward: bool, check: bool) -> None:
    """A one-line error before any process starts when the run cannot fit: P processes of about RANK_BYTES
    each, and the ranks' arrays — their Q, K, V shards, the two K/V blocks in flight, the output and its
    accumulator (about 12 arrays of B×H×N×E in all; 24 with the backward's dO, dQ and travelling dK/dV) — and
    with --check the parent's whole sequence, its result and the ranks' (8 more; 18 with the backward)."""
    avail = _available_bytes()
    if avail is None:
        return
    procs = P * RANK_BYTES
    if procs > avail:
        raise UserError(f"--nproc: P = {P} processes need about {procs / 2**30:,.1f} GiB (about "
                        f"{RANK_BYTES // 2**20} MB each for Python, torch and the engine), more than the "
                        f"{avail / 2**30:,.1f} GiB available here; give a smaller P")
    arrays = (24 if backward else 12) + ((18 if backward else 8) if check else 0)
    need = arrays * B * H * N * E * (8 if dtype == "float64" else 4)
    if procs + need > avail:
        raise UserError(f"--length/--heads/--dim/--batch: N = {N}, H = {H}, E = {E}, B = {B} need about "
                        f"{need / 2**30:,.1f} GiB for the arrays ({arrays} × B·H·N·E {dtype}"
                        f"{', with --check' if check else ''}{', with --backward' if backward else ''}), more than "
                        f"the {max(avail - procs, 0) / 2**30:,.1f} GiB available here besides the {P} processes; "
                        "give smaller ones")


#: The largest value of each count (stated in --help); memory bounds their product further (_check_memory).
MAXIMA = types.MappingProxyType(
    {"--length": 1 << 24, "--window": 1 << 24, "--heads": 1024, "--kv-heads": 1024, "--dim": 4096,
     "--batch": 4096, "--repeats": 100, "--threads": 1024})


@cli.command("ring")
@click.option("--nproc", "-p", type=int, required=True,
              help=f"Processes P (ranks of the ring): at most {PER_CORE} per core or {MIN_NPROC_LIMIT}, whichever "
                   f"is more, and no more than the memory holds at about {RANK_BYTES // 2**20} MB each.")
@click.option("--length", "-n", type=int, required=True,
              help="Sequence length N, 1 … 16,777,216 (a multiple of P for --layout contiguous, of 2·P for zigzag; "
                   "the arrays must fit in memory).")
@click.option("--heads", default=8, show_default=True, type=int, help="Query heads H (1 … 1024).")
@click.option("--kv-heads", default=None, type=int, help="Key/value heads (grouped-query, 1 … 1024; default H).")
@click.option("--dim", default=64, show_default=True, type=int, help="Head width E (1 … 4096).")
@click.option("--batch", default=1, show_default=True, type=int, help="Batch B (1 … 4096).")
@click.option("--causal", is_flag=True, help="Causal mask over the global positions.")
@click.option("--layout", type=click.Choice(["zigzag", "contiguous"]), default="zigzag", show_default=True,
              help="How the sequence is shared: zigzag (2·P chunks, rank r takes r and 2P−1−r) or contiguous.")
@click.option("--window", default=None, type=int, help="A causal sliding window of this many keys, 1 … 16,777,216 "
              "(a mask mod): ranks skip the steps whose blocks it leaves empty.")
@click.option("--dtype", type=click.Choice(["float32", "float64"]), default="float32", show_default=True)
@click.option("--backward", is_flag=True, help="Also run the ring backward (dK/dV travel with their blocks).")
@click.option("--check", is_flag=True, help="Compare with one process on the whole sequence (and time it).")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed of the random Q, K, V (>= 0).")
@click.option("--repeats", default=1, show_default=True, type=int,
              help="Timed runs of each (ring and one process), 1 … 100; times are medians.")
@click.option("--threads", default=None, type=int,
              help="Engine threads per process, 1 … 1024 (default: cores / P).")
@click.option("--timeout", default=None, type=float,
              help=f"Seconds any one wait of the ring may take, {MIN_TIMEOUT:g} … {MAX_TIMEOUT:g} (default 120; the "
                   f"whole run is stopped after {MAX_TIMEOUT:g} s).")
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON.")
def ring(nproc, length, heads, kv_heads, dim, batch, causal, layout, window, dtype, backward, check, seed, repeats,
         threads, timeout, as_json):
    """Run ring attention on P local processes and print the time per step and the bytes each rank sent.

    Each rank builds only its own shard (the sequence is defined chunk by chunk from the seed), passes K/V
    blocks around the ring with isend/irecv overlapping the tiled engine's compute, and merges by
    log-sum-exp. Exit code 0; 1 when --check finds a difference beyond the tolerance (float32 1e-5,
    float64 1e-12, relative to max(1, |value|)); 2 for bad input.
    """
    for name, val in (("--nproc", nproc), ("--length", length), ("--heads", heads), ("--kv-heads", kv_heads),
                      ("--dim", dim), ("--batch", batch), ("--threads", threads), ("--window", window),
                      ("--repeats", repeats)):
        if val is not None and val < 1:
            raise UserError(f"{name}: expected a positive integer, got {val}")
        if val is not None and name in MAXIMA and val > MAXIMA[name]:
            raise UserError(f"{name}: expected 1 … {MAXIMA[name]:,}, got {val:,}")
    if kv_heads is not None and heads % kv_heads:
        raise UserError(f"--kv-heads: must divide --heads ({heads}), got {kv_heads}")
    if seed < 0:
        raise UserError(f"--seed: expected a non-negative integer, got {seed}")
    if timeout is not None and not MIN_TIMEOUT <= timeout <= MAX_TIMEOUT:
        raise UserError(f"--timeout: expected {MIN_TIMEOUT:g} … {MAX_TIMEOUT:g} seconds, got {timeout}")
    cores = os.cpu_count() or 1
    most = max(MIN_NPROC_LIMIT, PER_CORE * cores)
    if nproc > most:
        raise UserError(f"--nproc: expected at most {most} processes here ({PER_CORE} per core, "
                        f"{_plural(cores, 'core')}; each takes about 1.6 s of CPU and {RANK_BYTES // 2**20} MB to "
                        f"start), got {nproc}")
    from qkv.integrations.distributed import length_error
    err = length_error(length, nproc, layout)
    if err:
        raise UserError(f"--length: {err}")
    _check_memory(nproc, length, batch, heads, dim, dtype, backward, check)
    try:
        import torch  # noqa: F401
    except ImportError:
        raise UserError("qkv ring needs torch (torch.distributed): pip install 'qkv[torch]'") from None
    from qkv.integrations.distributed import run_ring
    try:
        res = run_ring(nproc=nproc, length=length, heads=heads, kv_heads=kv_heads, dim=dim, batch=batch,
                       causal=causal, layout=layout, window=window, dtype=dtype, backward=backward, check=check,
                       seed=seed, timeout=timeout, threads=threads, repeats=repeats, quiet=True)
    except (RuntimeError, TimeoutError) as exc:
        raise UserError(f"the ring failed: {exc}") from None
    ok = not check or res["check"]["ok"]
    if as_json:
        for r in res["ranks"]:
            for key in ("out", "lse", "grads"):
                r.pop(key, None)
        click.echo(json.dumps(res, indent=2))
        return 0 if ok else 1
    click.echo("\n".join(_text(res)))
    return 0 if ok else 1


def _text(res: dict) -> list[str]:
    cfg, ranks = res["config"], res["ranks"]
    P = cfg["P"]
    mask = "causal" if cfg["causal"] else "no mask"
    if cfg["window"]:
        mask = f"sliding window {cfg['window']}"
    lines = [f"qkv ring: P={P} processes (gloo, 127.0.0.1), N={cfg['N']}, B={cfg['B']}, H={cfg['H']}"
             + (f" (kv {cfg['Hk']})" if cfg["Hk"] != cfg["H"] else "") + f", E={cfg['E']}, {cfg['dtype']}, {mask}, "
             f"{cfg['layout']} layout, {_plural(cfg['threads'], 'engine thread')} per process"
             + (f"; times: medians of {cfg['repeats']} runs" if cfg["repeats"] > 1 else "")]
    for part in ("forward", "backward"):
        if part not in ranks[0]:
            continue
        st = [r[part] for r in ranks]
        n_steps = st[0]["steps"]
        lines.append("")
        lines.append(f"{part}: {n_steps} ring steps; per step, ranks 0…{P - 1}: the block held (its owner), "
                     "compute ms, wait ms (transfer not hidden by the compute)")
        for s in range(n_steps):
            held = " ".join(str((r - s) % P) for r in range(P))
            comp = " ".join(("skip" if s in st[r]["skipped"] else _ms(st[r]["compute_s"][s])) for r in range(P))
            wait = " ".join(_ms(st[r]["wait_s"][s]) for r in range(P))
            lines.append(f"  step {s}: holds {held} | compute {comp} | wait {wait}")
        total = max(r[f"{part}_s"] for r in ranks)
        cpu = sum(r[f"{part}_cpu_s"] for r in ranks)
        lines.append(f"  {part} time: {_ms(total)} ms (slowest rank); CPU time of all ranks: {_ms(cpu)} ms")
        for r, x in enumerate(st):
            kv = max(n_steps - 1, 0)
            if part == "forward":
                what = _plural(x["messages"], "K/V message")
            else:
                what = f"{_plural(kv, 'K/V message')} + {_plural(x['messages'] - kv, 'dK/dV message')}"
            lines.append(f"  rank {r}: sent {what}, {_bytes(x['bytes'])}")
    lines.append("")
    peaks = " ".join(f"{r['peak_mb'] - r['base_mb']:.0f}" for r in ranks)
    lines.append(f"memory: peak RSS over the {ranks[0]['base_mb']:.0f} MB after imports, per rank: {peaks} MB "
                 f"(its Q, K, V shard: {ranks[0]['shard_mb']:.1f} MB)")
    if "check" in res:
        c = res["check"]
        fwd = max(r["forward_s"] for r in ranks)
        fcpu = sum(r["forward_cpu_s"] for r in ranks)
        ratio = f"ring / one process: forward {fwd / c['forward_s']:.2f}× time, {fcpu / c['forward_cpu_s']:.2f}× CPU"
        if "backward_s" in c:
            bwd = max(r["backward_s"] for r in ranks)
            bcpu = sum(r["backward_cpu_s"] for r in ranks)
            ratio += f"; backward {bwd / c['backward_s']:.2f}× time, {bcpu / c['backward_cpu_s']:.2f}× CPU"
        lines.append(f"one process ({_plural(c['threads'], 'thread')}): forward {_ms(c['forward_s'])} ms"
                     + (f", backward {_ms(c['backward_s'])} ms" if "backward_s" in c else "") + f"; {ratio}")
        diffs = ", ".join(f"{k} {c[k]['max_abs']:.2g}" for k in ("out", "lse", "dq", "dk", "dv") if k in c)
        verdict = "OK" if c["ok"] else "DIFFERENT"
        lines.append(f"check: {verdict} — max |ring − one process|: {diffs} (tolerance {c['tolerance']:g} relative "
                     "to max(1, |value|))")
    return lines
