"""Plots and Markdown tables from bench/compare.py's CSV, in the manner of the
SonicMoE paper's Figures 13 and 14: grouped bars per configuration, one bar
per implementation, one panel per model size.

  fwd_tflops.png   forward TFLOPS (6TKdn / forward time), with SonicMoE's
                   published H100 numbers (bench/grid.h) as their own bars
  bwd_tflops.png   backward TFLOPS (12TKdn / backward time), the same
  act_memory.png   activation memory (GiB held after the forward), with the
                   floor H + O + routing metadata of bench/grid.h as a mark

Only implementations whose status is 'ok' have bars; the tables say what
happened to the others (failed, error, unavailable, skipped).

    python3 bench/plot.py results.csv [--out bench/plots] [--table table.md]

Needs matplotlib (and nothing else: no torch).
"""
import argparse
import csv
import math
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
GRID_H = os.path.join(HERE, "grid.h")

# grid.h's smoe_grid_row numeric fields, in order after name and model.
GRID_FIELDS = ["T", "d", "n", "E", "K", "floor_act_gib", "sonicmoe_fwd", "sonicmoe_bwd",
               "torch_fwd", "torch_bwd", "torch_act_gib", "scattermoe_fwd", "scattermoe_bwd",
               "scattermoe_act_gib", "gemm_bound_fwd", "gemm_bound_bwd"]
PUBLISHED = "SonicMoE (published)"
COLORS = {
    "smoe-sm90": "#1f77b4",
    "smoe-cuda": "#6baed6",
    "smoe-cpu": "#9ecae1",
    "torch": "#ff7f0e",
    "scattermoe": "#2ca02c",
    "sonicmoe": "#d62728",
    PUBLISHED: "#f4a6a6",
}
MODELS = ["1.4B", "7B", "30B", "120B"]


def read_grid():
    """{row name: {field: float}} from bench/grid.h (the published numbers)."""
    rows = {}
    pat = re.compile(r'\{"([^"]+)",\s*"([^"]+)",([^}]*)\}')
    for line in open(GRID_H):
        m = pat.search(line)
        if not m:
            continue
        vals = [float(v) for v in m.group(3).split(",") if v.strip()]
        if len(vals) == len(GRID_FIELDS):
            rows[m.group(1)] = dict(zip(GRID_FIELDS, vals), model=m.group(2))
    return rows


def read_csv(path):
    """(header comment lines, records) of a compare.py CSV."""
    header, lines = [], []
    for line in open(path, newline=""):
        if line.startswith("#"):
            header.append(line[1:].strip())
        elif line.strip():
            lines.append(line)
    return header, list(csv.DictReader(lines))


def num(s):
    try:
        return float(s)
    except (TypeError, ValueError):
        return None


def collect(records):
    """Configurations in order, implementations in order, and
    {(row, impl): record}."""
    rows, impls, by = [], [], {}
    for r in records:
        if r["row"] not in rows:
            rows.append(r["row"])
        if r["impl"] not in impls:
            impls.append(r["impl"])
        by[(r["row"], r["impl"])] = r
    return rows, impls, by


def model_of(row, grid):
    if row in grid:
        return grid[row]["model"]
    return "other"


def row_label(row, by, impls, grid):
    r = grid.get(row)
    if r is None:
        rec = next(by[(row, im)] for im in impls if (row, im) in by)
        r = {k: num(rec[k]) for k in ("T", "d", "n", "E", "K")}
        return "T=%d d=%d\nn=%d E=%d K=%d" % (r["T"], r["d"], r["n"], r["E"], r["K"])
    return "n=%d\nE=%d K=%d" % (r["n"], r["E"], r["K"])


def title_of(header):
    keep = []
    for h in header:
        for key in ("device ", "date ", "torch ", "commit "):
            if h.startswith(key):
                keep.append(h.split(" (")[0] if key == "device " else h)
    return ", ".join(keep)


def bar_figure(metric, ylabel, rows, impls, by, grid, header, path, published=None, floor=None):
    """One PNG: a panel per model, grouped bars per configuration."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = [im for im in impls
              if any(by.get((r, im), {}).get("status") == "ok" and num(by[(r, im)].get(metric))
                     is not None for r in rows)]
    if not series:
        return False            # nothing measured (e.g. no memory numbers on CPU)
    if published and any(grid.get(r, {}).get(published, -1) >= 0 for r in rows):
        series.append(PUBLISHED)
    panels = [m for m in MODELS + ["other"] if any(model_of(r, grid) == m for r in rows)]
    ncols = min(2, len(panels))
    nrows = (len(panels) + ncols - 1) // ncols
    per_panel = max(sum(model_of(r, grid) == m for r in rows) for m in panels)
    fig, axes = plt.subplots(nrows, ncols, figsize=(1.0 + ncols * (1.2 + 1.9 * per_panel),
                                                    0.9 + 2.7 * nrows), squeeze=False)
    flat = [ax for line in axes for ax in line]
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    nser = max(1, len(series))
    bw = 0.8 / nser
    for ax, model in zip(flat, panels):
        prow = [r for r in rows if model_of(r, grid) == model]
        for j, s in enumerate(series):
            xs, ys = [], []
            for i, r in enumerate(prow):
                if s == PUBLISHED:
                    v = grid.get(r, {}).get(published, -1)
                    v = v if v >= 0 else None
                else:
                    rec = by.get((r, s), {})
                    v = num(rec.get(metric)) if rec.get("status") == "ok" else None
                    if rec.get("status") in ("failed", "error", "skipped"):
                        ax.text(i - 0.4 + bw * (j + 0.5), 0, rec["status"], rotation=90,
                                ha="center", va="bottom", fontsize=6, color="dimgray")
                if v is not None:
                    xs.append(i - 0.4 + bw * (j + 0.5))
                    ys.append(v)
            bars = ax.bar(xs, ys, bw, label=s, color=COLORS.get(s, None),
                          hatch="//" if s == PUBLISHED else None, edgecolor="white", linewidth=0.3)
            if len(prow) * nser <= 24:
                ax.bar_label(bars, fmt="%.0f" if metric != "act_gib" else "%.3g", fontsize=6,
                             padding=1)
        if floor:
            for i, r in enumerate(prow):
                v = grid.get(r, {}).get(floor, -1)
                if v >= 0:
                    ax.hlines(v, i - 0.45, i + 0.45, colors="black", linestyles="--", linewidth=1,
                              label="floor (H+O+routing)" if i == 0 else None)
        ax.set_xlim(-0.5, max(len(prow), per_panel) - 0.5)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.1)
        ax.set_xticks(range(len(prow)))
        ax.set_xticklabels([row_label(r, by, impls, grid) for r in prow], fontsize=7)
        ax.set_title(model if model == "other" else "%s (T=%d, d=%d)" % (
            model, grid[prow[0]]["T"], grid[prow[0]]["d"]), fontsize=9)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(axis="y", alpha=0.3)
        ax.set_axisbelow(True)
    for line in axes:
        line[0].set_ylabel(ylabel, fontsize=8)
    handles, labels = [], []
    for ax in flat:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    fig.legend(handles, labels, loc="upper center", ncol=min(len(labels), 7), fontsize=8,
               frameon=False, bbox_to_anchor=(0.5, 1.0))
    fig.suptitle(title_of(header), fontsize=7, y=0.005, va="bottom")
    top = 1.0 - 0.3 / fig.get_figheight()
    fig.tight_layout(rect=(0, 0.25 / fig.get_figheight(), 1, top))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def cell(rec, metric, fmt):
    if rec is None:
        return ""
    if rec.get("status") != "ok":
        return rec.get("status", "")
    v = num(rec.get(metric))
    return fmt % v if v is not None else ""


def geomean_ratio(rows, by, grid, a, b, metric, published):
    """Geometric mean of a/b over the configurations where both have a value
    (b may be PUBLISHED), and how many there were."""
    logs = []
    for r in rows:
        ra = by.get((r, a), {})
        va = num(ra.get(metric)) if ra.get("status") == "ok" else None
        if b == PUBLISHED:
            vb = grid.get(r, {}).get(published, -1)
            vb = vb if vb > 0 else None
        else:
            rb = by.get((r, b), {})
            vb = num(rb.get(metric)) if rb.get("status") == "ok" else None
        if va and vb:
            logs.append(math.log(va / vb))
    return (math.exp(sum(logs) / len(logs)), len(logs)) if logs else (None, 0)


def readme_section(rows, impls, by, grid, header, image_dir):
    """The README's comparison section: how it was measured, the plots, the
    tables (forward TFLOPS, backward TFLOPS, activation GiB), geometric-mean
    ratios, and what did not run."""
    all_impls = impls
    info = {}
    for h in header:
        key, _, rest = h.partition(" ")
        info.setdefault(key, rest)
    out = ["### Compared with other MoE layers", ""]
    others = "".join("; %s" % info[k] for k in ("sonicmoe:", "scattermoe:") if k in info)
    out.append("Measured with `bench/compare.py` in one run on one GPU: %s, %s; torch %s, "
               "triton %s%s; smoe commit %s. Every implementation gets the same router, expert "
               "weights, input, output gradient and routing decisions, and its output and "
               "gradients (dx, drouter, dw1, dw2) are checked against an fp32 reference before "
               "it is timed (relative L2 error below the tolerance). bf16, SwiGLU, top-K then "
               "softmax routing; TFLOPS count only the expert GEMMs (6TKdn forward, 12TKdn "
               "backward); medians of CUDA-event timings with the L2 cache flushed and a "
               "GPU-side delay before each start event, so that the host's launch overhead "
               "is not timed (as in a training loop; see compare.py); activation memory is "
               "what one training-mode forward leaves allocated (outputs included). %s is "
               "SonicMoE's paper (H100), not measured here."
               % (info.get("device", "?"), info.get("date", "?"), info.get("torch", "?"),
                  info.get("triton", "?"), others, info.get("commit", "?"), PUBLISHED))
    out.append("")
    for fname, alt in (("fwd_tflops.png", "forward TFLOPS"), ("bwd_tflops.png", "backward TFLOPS"),
                       ("act_memory.png", "activation memory")):
        if os.path.exists(os.path.join(image_dir, fname)):
            rel = os.path.relpath(os.path.join(image_dir, fname), os.path.dirname(HERE))
            out.append("![%s](%s)" % (alt, rel))
    out.append("")
    # Implementations that never ran get no column (the notes below say why).
    impls = [im for im in impls if any(by.get((r, im), {}).get("status") not in
                                       (None, "unavailable") for r in rows)]
    specs = [("Forward TFLOPS", "fwd_tflops", "%.0f", "sonicmoe_fwd"),
             ("Backward TFLOPS", "bwd_tflops", "%.0f", "sonicmoe_bwd"),
             ("Activation memory (GiB)", "act_gib", "%.2f", "floor_act_gib")]
    for title, metric, fmt, extra in specs:
        extra_name = "floor (H+O+routing)" if extra == "floor_act_gib" else PUBLISHED
        out.append("**%s**" % title)
        out.append("")
        out.append("| config | T | d | n | E | K | " + " | ".join(impls) + " | %s |" % extra_name)
        out.append("|" + "---|" * (6 + len(impls) + 1))
        for r in rows:
            rec0 = next(by[(r, im)] for im in all_impls if (r, im) in by)
            ev = grid.get(r, {}).get(extra, -1)
            cells = [r] + [rec0[k] for k in ("T", "d", "n", "E", "K")]
            cells += [cell(by.get((r, im)), metric, fmt) for im in impls]
            cells.append(fmt % ev if ev is not None and ev >= 0 else "")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    ratios = []
    for a in impls:
        for b in [im for im in impls if im != a and not im.startswith("smoe")] + [PUBLISHED]:
            if not a.startswith("smoe"):
                continue
            parts = []
            for metric, published in (("fwd_tflops", "sonicmoe_fwd"),
                                      ("bwd_tflops", "sonicmoe_bwd")):
                g, cnt = geomean_ratio(rows, by, grid, a, b, metric, published)
                if g is not None:
                    parts.append("%s %.2fx (%d configs)" % (metric.split("_")[0], g, cnt))
            if parts:
                ratios.append("- %s / %s: %s" % (a, b, ", ".join(parts)))
    if ratios:
        out.append("Geometric means of the TFLOPS ratios:")
        out.append("")
        out.extend(ratios)
        out.append("")
    notes = [(r, im, by[(r, im)]) for r in rows for im in all_impls
             if (r, im) in by and by[(r, im)].get("status") != "ok"]
    seen = set()
    lines = []
    for r, im, rec in notes:
        key = (im, rec.get("status"), rec.get("note"))
        if key in seen:
            continue
        seen.add(key)
        lines.append("- %s, %s (first at %s): %s" % (im, rec.get("status"), r, rec.get("note", "")))
    if lines:
        out.append("Not measured:")
        out.append("")
        out.extend(lines)
        out.append("")
    if "command" in info:
        out.append("Reproduce (after `make lib`; see notes/compare.md):")
        out.append("")
        out.append("```sh")
        out.append("python3 " + re.sub(r"--csv\s+\S+", "--csv results.csv", info["command"]))
        out.append("python3 bench/plot.py results.csv")
        out.append("```")
    return "\n".join(out) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--out", default=os.path.join(HERE, "plots"), help="folder for the PNGs")
    ap.add_argument("--table", help="write the README section (Markdown: tables, plots, notes) "
                    "here (default: print it)")
    args = ap.parse_args()
    header, records = read_csv(args.csv)
    if not records:
        sys.exit("plot.py: no records in %s" % args.csv)
    grid = read_grid()
    rows, impls, by = collect(records)
    os.makedirs(args.out, exist_ok=True)
    figs = [("fwd_tflops", "forward TFLOPS", "sonicmoe_fwd", None),
            ("bwd_tflops", "backward TFLOPS", "sonicmoe_bwd", None),
            ("act_gib", "activation memory (GiB)", None, "floor_act_gib")]
    names = {"fwd_tflops": "fwd_tflops.png", "bwd_tflops": "bwd_tflops.png",
             "act_gib": "act_memory.png"}
    for metric, ylabel, published, floor in figs:
        path = os.path.join(args.out, names[metric])
        if bar_figure(metric, ylabel, rows, impls, by, grid, header, path, published, floor):
            print("wrote %s (%d bytes)" % (path, os.path.getsize(path)))
        else:
            print("%s: no %s measured, no plot" % (names[metric], metric))
    md = readme_section(rows, impls, by, grid, header, args.out)
    if args.table:
        with open(args.table, "w") as f:
            f.write(md)
        print("wrote %s" % args.table)
    else:
        print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
