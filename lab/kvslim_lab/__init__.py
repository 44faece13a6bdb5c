"""kvslim's laboratory: the benchmarks (`kvslim bench`, bench/), the experiments (`kvslim
experiment`, experiments/) and their command lines (cli/). It depends on kvslim; kvslim never
imports it."""
