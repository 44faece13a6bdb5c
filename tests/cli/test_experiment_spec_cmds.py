"""Which targets and proposers `kvslim experiment speculative` measures: Gemma 3 (a base model,
plain prompts) with n-gram, lookahead and its learned drafters, each also as a tree when one is
given; --only keeps the arms it names."""
import json

from kvslim_lab.cli.experiment_spec_cmds import _targets
from kvslim.cli.main import build_parser


def fake_drafter(path, kind):
    path.mkdir()
    if kind == "medusa":
        (path / "medusa_lm_head.safetensors").write_bytes(b"")
        (path / "config.json").write_text(json.dumps({"medusa_num_heads": 2}))
    else:
        (path / "model.safetensors").write_bytes(b"")
        (path / "config.json").write_text("{}")
    return str(path)


def test_gemma3_is_a_plain_prompt_target_with_its_drafters(tmp_path):
    medusa = fake_drafter(tmp_path / "g-medusa", "medusa")
    eagle = fake_drafter(tmp_path / "g-eagle", "eagle")
    args = build_parser().parse_args(
        ["experiment", "speculative", "--ref-model", "", "--skip-smollm2", "--gemma3",
         "gemma3-270m", "--gemma3-drafters", medusa, eagle, "--num-speculative-tokens", "3"])
    args.drafter_tree = [[0], [1]]
    (target,) = _targets(args, tmp_path)
    assert (target.name, target.model, target.chat) == ("Gemma-3-270M", "gemma3-270m", False)
    assert target.proposers["medusa g-medusa"] == {"method": "medusa", "model": medusa,
                                                   "num_speculative_tokens": 2}
    assert target.proposers["eagle g-eagle"]["num_speculative_tokens"] == 3
    assert target.proposers["eagle g-eagle tree"]["tree"] == [[0], [1]]
    assert list(target.proposers) == ["ngram", "lookahead", "medusa g-medusa",
                                      "medusa g-medusa tree", "eagle g-eagle",
                                      "eagle g-eagle tree"]


def test_without_gemma3_no_gemma3_target(tmp_path):
    args = build_parser().parse_args(["experiment", "speculative", "--ref-model", "",
                                      "--skip-smollm2"])
    args.drafter_tree = None
    assert _targets(args, tmp_path) == []


def test_lookahead_arm_takes_its_options_and_only_keeps_the_named_arms(tmp_path):
    eagle = fake_drafter(tmp_path / "g-eagle", "eagle")
    args = build_parser().parse_args(
        ["experiment", "speculative", "--ref-model", "", "--skip-smollm2", "--gemma3",
         "gemma3-270m", "--gemma3-drafters", eagle, "--lookahead",
         '{"window": 4, "ngram": 3, "guesses": 2}', "--only", "ngram", "lookahead"])
    args.drafter_tree = None
    (target,) = _targets(args, tmp_path)
    assert list(target.proposers) == ["ngram", "lookahead"]
    assert target.proposers["lookahead"] == {"method": "lookahead", "prompt_lookup_min": 2,
                                             "prompt_lookup_max": 4, "window": 4, "ngram": 3,
                                             "guesses": 2}
    args.lookahead = ""                    # '' leaves the arm out
    assert list(_targets(args, tmp_path)[0].proposers) == ["ngram"]
