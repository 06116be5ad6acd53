"""EP scaling plot from build/smoe_ep_bench's raw text output.

Reads the blocks before the first '## ' line of a smoe_ep_bench log (e.g.
bench/results/ep_p4_h200x4_2026-11-26.txt): each starts with a
'# <device> x P; <row> T = ...' header, then the EP line of the default
schedule, the EP line of 'no overlap' and the single-GPU line (fwd ms, bwd ms).
Later '## ' sections (sweeps) are ignored. For each shape and P it computes the
per-GPU EP / single-GPU throughput of forward + backward,
(single_fwd + single_bwd) / (ep_fwd + ep_bwd) * 100, for both EP lines.

Writes grouped bars (x: shape, one bar per P for the default schedule, a black
tick for no overlap, a dashed 85% target) to --out (bench/plots/ep_scaling.png)
and prints a Markdown table (shape | P=... , cells 'default% (no overlap%)').

    python3 bench/ep_plot.py LOG [--out PNG] [--names LABEL ... | SHAPE:LABEL ...]
    python3 bench/ep_plot.py LOG --quick "4 x H200" [--out PNG]

--quick reads instead the layer's defaults from quick lines (smoe_ep_bench -q
1, each line prefixed '<shape> r<round> | '; see parse_quick): bars are the
mean over rounds, a line the range.

Needs matplotlib only (no torch).
"""
import argparse
import re
import sys

HDR = re.compile(r"^# (.+?) x (\d+);\s*(\S*)\s*T = (\d+) tokens per GPU, d = (\d+), "
                 r"n = (\d+), E = (\d+), K = (\d+)")
DEFAULT_NAMES = ["30B-n512", "120B-n1024", "Qwen3-30B-A3B-like", "Mixtral-8x7B-like"]


def ms(line):  # the last five columns: fwd ms, bwd ms, fwd TF, bwd TF, total TF
    f = line.split()[-5:]
    return float(f[0]), float(f[1])


def parse(path):
    """-> (device, [shape], {(shape, P): (default %, no overlap %, default path is no overlap)})"""
    res, shapes, device, blk = {}, [], None, None
    lines = open(path).read().splitlines() + ["## end"]
    for line in lines:
        m = HDR.match(line)
        if (m or line.startswith("## ")) and blk:  # close the block before this line
            if len(blk["ep"]) < 2 or "single" not in blk:
                sys.exit(f"{path}: incomplete block for {blk['key']}")
            (ef, eb), (nf, nb) = blk["ep"][:2]
            sf, sb = blk["single"]
            if blk["key"] in res:
                print(f"warning: {blk['key']} seen twice, keeping the later", file=sys.stderr)
            res[blk["key"]] = (100 * (sf + sb) / (ef + eb), 100 * (sf + sb) / (nf + nb),
                               blk["default_no_overlap"])
            blk = None
        if line.startswith("## "):
            break
        if m:
            dev, p, row, T, d, n, E, K = m.groups()
            shape = row or f"T={T} d={d} n={n} E={E} K={K}"
            if shape not in shapes:
                shapes.append(shape)
            if device is None or int(p) > device[1]:
                device = (dev, int(p))
            blk = {"key": (shape, int(p)), "ep": [], "default_no_overlap": False}
        elif blk and line.startswith("EP P="):
            if not blk["ep"]:
                blk["default_no_overlap"] = "no overlap" in line
            blk["ep"].append(ms(line))
        elif blk and line.startswith("single GPU"):
            blk["single"] = ms(line)
    if not res:
        sys.exit(f"{path}: no '# ... x P; ...' blocks before the first '## '")
    return f"{device[0]} x {device[1]}", shapes, res


QUICK = re.compile(r"^(\S+) r\d+(?: \S+)? \| quick .*?P=(\d+) T=\d+: EP fwd ([\d.]+) bwd ([\d.]+) ms.*?"
                   r"single fwd ([\d.]+) bwd ([\d.]+) ms")


def parse_quick(path, device):
    """--quick: lines '<shape> r<round> | quick ... P=<P> T=...: EP fwd .. bwd .. ms, ...,
    single fwd .. bwd .. ms' (smoe_ep_bench -q 1, the layer's defaults, each
    line its own single-GPU run); a cell is the mean over rounds, its range
    printed beside it. No no-overlap tick (the quick lines run the defaults only)."""
    runs, shapes = {}, []
    for line in open(path):
        m = QUICK.match(line)
        if not m:
            continue
        shape, p = m.group(1), int(m.group(2))
        ef, eb, sf, sb = (float(x) for x in m.groups()[2:])
        if shape not in shapes:
            shapes.append(shape)
        runs.setdefault((shape, p), []).append(100 * (sf + sb) / (ef + eb))
    if not runs:
        sys.exit(f"{path}: no quick lines")
    res = {k: (sum(v) / len(v), None, False, min(v), max(v)) for k, v in runs.items()}
    return device, shapes, res


def labels(shapes, names):
    byname = dict(x.split(":", 1) for x in names if ":" in x)
    plain = [x for x in names if ":" not in x]
    out = [byname.get(s, plain[i] if i < len(plain) else s) for i, s in enumerate(shapes)]
    for s, lab in zip(shapes, out):
        print(f"label {lab!r} <- shape {s!r}", file=sys.stderr)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("log", help="smoe_ep_bench text output")
    ap.add_argument("--out", default="bench/plots/ep_scaling.png")
    ap.add_argument("--names", nargs="*", default=DEFAULT_NAMES,
                    help="labels in order of first appearance, or SHAPE:LABEL pairs")
    ap.add_argument("--quick", metavar="DEVICE",
                    help="read quick lines (parse_quick) of a machine named DEVICE")
    a = ap.parse_args()
    device, shapes, res = parse_quick(a.log, a.quick) if a.quick else parse(a.log)
    labs = labels(shapes, a.names if not a.quick else [])
    ps = sorted({p for _, p in res})

    print("| shape | " + " | ".join(f"P={p}" for p in ps) + " |")
    print("|---" * (len(ps) + 1) + "|")
    for s, lab in zip(shapes, labs):
        cells = ["-" if (s, p) not in res else
                 f"{res[s, p][0]:.1f}% ({res[s, p][3]:.1f}-{res[s, p][4]:.1f})" if a.quick else
                 f"{res[s, p][0]:.1f}% ({res[s, p][1]:.1f}%)" for p in ps]
        print(f"| {lab} | " + " | ".join(cells) + " |")
    if a.quick:
        print("\nCells are the layer's defaults, fwd+bwd per GPU, EP / single GPU: mean over "
              "rounds (range).")
    same = [] if a.quick else [f"{lab} P={p}" for s, lab in zip(shapes, labs) for p in ps
            if (s, p) in res and res[s, p][2]]
    if not a.quick:
        print("\nCells are default schedule (no overlap), fwd+bwd per GPU, EP / single GPU. Where the "
          "default schedule is itself no overlap, both are runs of the same path: "
              + ", ".join(same))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: E402 (after the backend choice)
    fig, ax = plt.subplots(figsize=(9, 5))
    w = 0.8 / len(ps)
    colors = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    for j, p in enumerate(ps):
        xs = [i - 0.4 + w * (j + 0.5) for i, s in enumerate(shapes) if (s, p) in res]
        vals = [res[s, p] for s in shapes if (s, p) in res]
        ax.bar(xs, [v[0] for v in vals], w * 0.9, color=colors[j % 4],
               label=f"P={p} ({'layer defaults' if a.quick else 'default schedule'})")
        if a.quick:  # the rounds' range
            ax.vlines(xs, [v[3] for v in vals], [v[4] for v in vals], colors="black", lw=1.2,
                      label="range over rounds" if j == 0 else None)
        else:
            ax.hlines([v[1] for v in vals], [x - w * 0.45 for x in xs],
                      [x + w * 0.45 for x in xs], colors="black", lw=2,
                      label="no overlap (tick)" if j == 0 else None)
        for x, v in zip(xs, vals):
            ax.text(x, v[0] / 2, f"{v[0]:.0f}", ha="center", color="black" if j == 0 else "white",
                    fontsize=9)
    ax.axhline(85, ls="--", color="#d62728", lw=1.2, label="target")
    ax.text(len(shapes) - 0.45, 86, "target 85%", color="#d62728", ha="right", fontsize=8)
    ax.set_xticks(range(len(shapes)), labs)
    ax.set_ylim(0, 100)
    ax.set_ylabel("fwd+bwd throughput, % of single GPU")
    ax.set_title(f"{device}: expert parallel scaling\n"
                 "per GPU, EP / single GPU at equal tokens per GPU", fontsize=11)
    ax.legend(loc="lower left", fontsize=8, framealpha=0.9)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
