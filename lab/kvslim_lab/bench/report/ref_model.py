"""The reference model (the project's own 6-layer MHA Llama, `models/ref-mha`) at batch 1 against
llama.cpp, with the peers run's engines: llama.cpp's Q4_0 and Q4_1 files of it (llama-quantize of
its F32 export), kvslim on the Q4_1 file's blocks (the same file, imported) and kvslim on the
float32 model as trained — those of the run's `--engines` — taking turns round by round; then the
profile of kvslim's faster engine, the reason a missed goal is given."""
from __future__ import annotations

from pathlib import Path

from kvslim_lab.bench.peers import catalog
from kvslim_lab.bench.peers.suite import PeersPlan, Unavailable, run_peers
from kvslim_lab.bench.workload import Workload

REF_ENGINES = {
    "kvslim-q4_1": "kvslim on llama.cpp's Q4_1 file (its blocks)",
    "kvslim-f32": "kvslim float32 (the model as trained)",
    "llamacpp-q4_0": "llama.cpp Q4_0",
    "llamacpp-q4_1": "llama.cpp Q4_1",
}


def ref_engines(ref_dir: Path, names: list[str], opts: catalog.PeerOptions) -> dict:
    """name -> (engine, its model directory or None): the peers' engine classes on the
    reference model's files, made once under $KVSLIM_HOME/peers/<model>."""
    from kvslim_lab.bench.llamacpp_tools import LlamaCppTools
    from kvslim_lab.bench.peers.llamacpp import LlamaCppEngine, gguf_file
    from kvslim_lab.bench.peers.local import KvslimEngine
    from kvslim_lab.bench.runners import exported_gguf
    from kvslim.formats.registry import imported_gguf_dir
    work = catalog.work_dir(opts) / ref_dir.name / "gguf"
    tools = LlamaCppTools(Path(opts.llamacpp_bin), opts.threads)

    def f32() -> Path:
        return exported_gguf(ref_dir, "f32")

    def q4_1_blocks() -> Path:
        if tools.missing():                          # the file comes from llama-quantize
            raise Unavailable(tools.missing())
        return imported_gguf_dir(gguf_file(tools, "q4_1", f32(), work), show_progress=False,
                                 quantized=True)
    dirs = {"kvslim-q4_1": q4_1_blocks, "kvslim-f32": lambda: ref_dir}
    out = {}
    for name in [n for n in REF_ENGINES if n in names]:
        if name in dirs:
            out[name] = (KvslimEngine(name, REF_ENGINES[name], dirs[name], max_num_seqs=4),
                         dirs[name])
        else:
            out[name] = (LlamaCppEngine(name.split("-", 1)[1], REF_ENGINES[name], tools, f32,
                                        work), None)
    return out


def run_ref(ref_dir: Path, names: list[str], settings, opts, machine: dict, bandwidth: dict,
            profile_steps: int, show_progress: bool) -> dict:
    """{"model", "peers": the decode-only peers result, "profiled_engine", "profile"}."""
    from kvslim_lab.bench.profile import profile_decode
    engines = ref_engines(Path(ref_dir), names, opts)
    plan = PeersPlan(Workload(1, settings.input_len, settings.decode_len, seed=1), None,
                     settings.rounds)
    result = run_peers([e for e, _ in engines.values()], catalog.prompts(plan, Path(ref_dir)),
                       plan, machine, bandwidth, opts.threads, show_progress).to_dict()
    speeds = {e["engine"]: e["decode"]["tokens_per_s"] for e in result["engines"]
              if e["engine"].startswith("kvslim") and e["decode"]["tokens_per_s"]}
    out = {"model": Path(ref_dir).name, "peers": result, "profiled_engine": None,
           "profile": None}
    if speeds:
        best = max(speeds, key=speeds.get)
        out["profiled_engine"] = best
        out["profile"] = profile_decode(engines[best][1](), (1,), settings.input_len,
                                        profile_steps).to_dict()
    return out
