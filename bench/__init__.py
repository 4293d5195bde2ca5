"""The benchmarks, in three layers: `kit/` (what they share: processes, nginx, load generators,
/proc readings, the page writer), `scenarios/` (what `make bench` runs, in one registry) and
`oneoff/` (investigations run on their own, `python -m bench.oneoff.NAME`). `run.py` is the entry
point (`python -m bench.run`); nothing imports it."""
