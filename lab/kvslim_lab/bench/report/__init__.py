"""`kvslim bench report`: docs/benchmarks.md (+ benchmarks.json and PNGs under docs/img/)
regenerated around one peers run (bench/peers/), with what issue 31's goals need beside it in
the same invocation: the compiled decode step against eager at every batch, where a decode step's
time goes (eager and compiled), `kvslim serve`'s start-up, the reference model against llama.cpp,
and the GQA capacity check. `plan.py` holds the plans and the parts, `measure.py` runs them and
writes the JSON, `ref_model.py` is the reference-model part, `goals.py` checks the goals against
the JSON, `render.py` writes the page and `plots.py` its PNGs, from the JSON alone."""
