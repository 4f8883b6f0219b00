import json, sys
d = json.load(open(sys.argv[1]))
for c in d["cases"]:
    t = c.get("timing") or {}
    p = c["params"]
    print(f'{p.get("T")!s:>6} B{p["B"]} ragged={bool(p.get("ragged"))} {c["backend"]:<13} {c["status"]:<8} '
          f'median_ms={t.get("median_ms", t.get("ms_median"))} host_ms={t.get("host_ms")} {c.get("reason","")[:100]}')
