#!/usr/bin/env python3
"""Sums up the EP layer's event traces (SMOE_EP_TRACE=1, src/cuda/ep_trace.cu)
into one line per rank and direction: where a call's time went.

    SMOE_EP_TRACE=1 smoe_ep_bench -P 4 -r 30B-n512 -x 524288 -q 2 2> trace.log
    python3 bench/ep_trace_sum.py trace.log [more logs ...]

Columns (ms, means over the traced calls; s is the caller's stream):
  total  the call's last mark ("end")
  pre    up to the first chunk's wait: routing, pack, counts, metadata
         (the forward), the pack and the exchanges' enqueue (the backward)
  wait   the steps that end at a chunk's "in" mark: the stream waiting for
         that chunk's rows (and, before the first, nothing else)
  gemms  the steps that end at a chunk's "gemms" mark
  sums   the steps that end at "sums" (forward) or "pieces" (backward)
  after  from the last chunk's last mark to "end": the join (the last
         partial sums), the final aggregation; in the backward dW2, dW1,
         the router and dx
  join   of that, the step that ends at "join" (waiting for the exchanges'
         stream), and in the backward the one at "exchanges in"
"""
import re
import sys

HEAD = re.compile(r"^smoe ep trace, rank (\d+) of (\d+), (forward|backward), mean of (\d+) calls")
LINE = re.compile(r"^\s+r(\d+) ([sc])\s+([\d.]+) ms\s+\+\s*([\d.]+)\s+(.*)$")


def parse(path):
    """[(rank, P, direction, calls, [(stream, t, step, name)])]"""
    out, cur = [], None
    with open(path, errors="replace") as f:
        for line in f:
            m = HEAD.match(line)
            if m:
                cur = (int(m.group(1)), int(m.group(2)), m.group(3), int(m.group(4)), [])
                out.append(cur)
                continue
            m = LINE.match(line)
            if m and cur is not None and int(m.group(1)) == cur[0]:
                cur[4].append((m.group(2), float(m.group(3)), float(m.group(4)), m.group(5)))
    return out


def summary(marks):
    s = [(t, step, name) for st, t, step, name in marks if st == "s"]
    total = max((t for t, _, name in s if name == "end"), default=0.0)
    first_in = min((t - step for t, step, name in s if name.startswith("in, chunk")), default=total)
    chunk = [(t, step, name) for t, step, name in s if ", chunk" in name]
    last_chunk = max((t for t, _, _ in chunk), default=first_in)

    def tot(prefix):
        return sum(step for _, step, name in chunk if name.startswith(prefix))

    sums = tot("sums, chunk") + tot("pieces, chunk")
    join = sum(step for _, step, name in s if name in ("join", "exchanges in"))
    return total, first_in, tot("in, chunk"), tot("gemms, chunk"), sums, total - last_chunk, join


def main(paths):
    print("%-28s %4s %-8s %5s %7s %7s %7s %7s %7s %7s %7s" %
          ("log", "rank", "dir", "calls", "total", "pre", "wait", "gemms", "sums", "after", "join"))
    for path in paths:
        for rank, P, d, calls, marks in parse(path):
            total, pre, wait, gemms, sums, after, join = summary(marks)
            print("%-28s %4s %-8s %5d %7.3f %7.3f %7.3f %7.3f %7.3f %7.3f %7.3f" %
                  (path[-28:], "%d/%d" % (rank, P), d, calls, total, pre, wait, gemms, sums,
                   after, join))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
