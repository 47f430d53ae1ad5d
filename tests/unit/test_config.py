"""Typed configs: YAML + key=value overrides, and errors that name the key."""

from __future__ import annotations

import re

import numpy as np
import pytest

from parity import config
from parity.commands.mismatch import MismatchConfig
from parity.config import ConfigError


def test_yaml_and_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_prompts: 8\nsampling:\n  top_k: 5\npairs: [fp16/fp16]\n")
    cfg = config.load(MismatchConfig, f, ["sampling.temperature=0.5", "pairs=bf16/fp32,fp32/fp32"])
    assert cfg.num_prompts == 8 and cfg.sampling.top_k == 5 and cfg.sampling.temperature == 0.5
    assert cfg.pairs == ["bf16/fp32", "fp32/fp32"]
    assert cfg.group_size == MismatchConfig().group_size


def test_exponent_numbers_without_a_dot(tmp_path):
    """YAML 1.1 reads `2e-4` as a string; a float key still takes it, from a file or key=value."""
    from parity.rl.train_config import TrainConfig

    f = tmp_path / "c.yaml"
    f.write_text("trainer:\n  lr: 3e-5\n")
    assert config.load(TrainConfig, f).trainer.lr == 3e-5
    assert config.load(TrainConfig, None, ["trainer.lr=2e-4"]).trainer.lr == 2e-4
    with pytest.raises(ConfigError, match="trainer.lr: expected a number, got 'fast'"):
        config.load(TrainConfig, None, ["trainer.lr=fast"])


def test_unknown_key_names_file_line_and_the_key_it_misspells(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("num_prompts: 8\nsampling:\n  topk: 5\n")
    line = r"/c.yaml:3: unknown config key sampling.topk; did you mean sampling.top_k\?$"
    with pytest.raises(ConfigError, match=line):
        config.load(MismatchConfig, f)
    f.write_text("num_prompts: 8\nsampling:\n  zzz: 5\n")  # like no key: the keys allowed there
    with pytest.raises(ConfigError, match=r"c.yaml:3: unknown config key sampling.zzz; allowed keys here: .*top_k"):
        config.load(MismatchConfig, f)


def test_a_renamed_key_still_loads(tmp_path):
    """`algorithm.shadow_forward` became `algorithm.probe`: a config.yaml saved before still loads (so a run
    saved then resumes), and an error under the old name points at its line."""
    from parity.rl.train_config import TrainConfig

    f = tmp_path / "c.yaml"
    f.write_text("steps: 3\nalgorithm:\n  shadow_forward: true\n")
    assert config.load(TrainConfig, f).algorithm.probe is True
    assert config.load(TrainConfig, None, ["algorithm.shadow_forward=true"]).algorithm.probe is True
    f.write_text("steps: 3\nalgorithm:\n  shadow_forward: maybe\n")
    with pytest.raises(ConfigError, match="c.yaml:3: algorithm.probe: expected true or false"):
        config.load(TrainConfig, f)


def test_wrong_type_names_key(tmp_path):
    with pytest.raises(ConfigError, match="num_prompts: expected an integer, got 'many'"):
        config.load(MismatchConfig, None, ["num_prompts=many"])
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\nsampling: 3\n")
    with pytest.raises(ConfigError, match="c.yaml:2: sampling: expected a mapping"):
        config.load(MismatchConfig, f)


def test_python_values_from_the_api_take_their_plain_form_or_one_line():
    """What `parity.train(**keys)` may be given that YAML never gives: NumPy numbers and tuples are taken as the
    int, float and list they hold (config.yaml records those); any other value is quoted on one short line."""
    from parity.rl.train_config import TrainConfig

    values = {"steps": np.int64(3), "trainer.lr": np.float32(0.5), "log.to": ("wandb",), "seed": np.uint8(7)}
    cfg = config.load(TrainConfig, None, None, values)
    assert (cfg.steps, cfg.trainer.lr, cfg.log.to, cfg.seed) == (3, 0.5, ["wandb"], 7)
    assert type(cfg.steps) is int and type(cfg.trainer.lr) is float and "numpy" not in config.dump_yaml(cfg)

    class Unprintable:
        def __repr__(self):
            raise RuntimeError("no repr")

    for value in (np.zeros((40, 40)), "x\n" * 500, Unprintable(), np.bool_(True), 2**200 * 1.0j):
        for key in ("steps", "trainer.lr", "precision", "log.to", "tensorboard", "rollout"):
            with pytest.raises(ConfigError) as e:
                config.load(TrainConfig, None, None, {key: value})
            assert str(e.value).startswith(f"{key}") and "\n" not in str(e.value) and len(str(e.value)) < 200


def test_described_names_the_type_and_stays_one_line():
    class Plain:
        pass

    def score():
        pass

    assert config.described(5) == "int 5" and config.described("yes") == "str 'yes'"
    assert config.described(Plain()) == "Plain object" and config.described(Plain) == "the class Plain"
    assert config.described(score) == "function score"  # its name, not its address
    big = config.described(np.ones((100, 100)))
    assert big.startswith("ndarray array([[1., 1.,") and big.endswith("...") and "\n" not in big


def test_bad_values_are_rejected():
    with pytest.raises(ConfigError, match="pairs: 'fp8/fp16' is not TRAINER/ROLLOUT"):
        config.load(MismatchConfig, None, ["pairs=fp8/fp16"])
    with pytest.raises(ConfigError, match="top_p must be in"):
        config.load(MismatchConfig, None, ["sampling.top_p=1.5"])
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        config.load(MismatchConfig, None, ["num_prompts"])


def test_invalid_yaml_names_line(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("seed: 1\nsampling: [\n")
    with pytest.raises(ConfigError, match=r"c.yaml:\d+: invalid YAML"):
        config.load(MismatchConfig, f)
    with pytest.raises(ConfigError, match="does not exist"):
        config.load(MismatchConfig, tmp_path / "missing.yaml")


def test_estimator_defaults_come_from_the_references():
    """Unset algorithm keys take the estimator's reference values, and config.yaml records them."""
    from parity.rl.train_config import TrainConfig

    def algo(*keys):
        return config.load(TrainConfig, None, list(keys)).algorithm

    a = algo()  # pg_seq_is, the paper's recipe: Dr.GRPO, zero reward without EOS, ÷ L_max, no cap
    assert (a.advantage, a.truncated, a.aggregation, a.cap) == (
        "drgrpo",
        "zero_reward",
        "seq_mean_token_sum_norm",
        None,
    )
    assert algo("algorithm.name=grpo_token_tis").cap == 2.0
    assert algo("algorithm.name=grpo_seq_mis").cap == 10.0
    assert algo("algorithm.name=pg_seq_tis").cap == 3.0
    geo = algo("algorithm.name=grpo_seq_geo_rs")
    assert (geo.cap_low, geo.cap) == (0.99, 1.01)
    gspo = algo("algorithm.name=gspo")
    assert (gspo.aggregation, gspo.advantage) == ("seq_mean_token_mean", "grpo")
    assert algo("task.name=length").truncated == "keep"  # a zero reward would be the best one there
    assert algo("algorithm.name=grpo_seq_mis", "algorithm.cap=4").cap == 4.0  # overridable
    assert "cap: 2.0" in config.dump_yaml(config.load(TrainConfig, None, ["algorithm.name=grpo_token_tis"]))
    # Each estimator's own keys, from its registry line; the clip bounds too.
    assert (gspo.clip_low, gspo.clip_high) == (3e-4, 4e-4)
    tv = algo("algorithm.name=dppo_tv")
    assert (tv.clip_low, tv.clip_high, tv.cap, tv.cap_low, tv.advantage) == (0.15, 0.15, 10000.0, None, "drgrpo")
    sapo = algo("algorithm.name=sapo")
    assert (sapo.tau_pos, sapo.tau_neg, sapo.aggregation, sapo.clip_low) == (1.0, 1.05, "seq_mean_token_mean", None)
    assert algo("algorithm.name=grpo_opsm").delta == 0.5 and algo("algorithm.name=grpo_seq_max_k3").delta == 2.5
    assert algo("algorithm.name=cispo", "algorithm.clip_low=1", "algorithm.clip_high=4").clip_high == 4.0


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (["algorithm.name=gspo", "algorithm.aggregation=seq_mean_token_sum_norm"], "gspo is defined per sequence"),
        (["algorithm.kl_estimator=k1"], "zero expected gradient"),
        (["algorithm.cap=2"], "pg_seq_is does not use it .*pg_seq_tis"),
        (["algorithm.name=grpo_seq_tis", "algorithm.cap_low=3", "algorithm.cap=2"], "need 0 <= cap_low < cap"),
        (["algorithm.token_veto=1.5"], "algorithm.token_veto: must be in"),
        (["algorithm.name=grpo", "algorithm.clip_high=0"], r"algorithm.clip_high: must be > 0, got 0.0"),
        (["algorithm.clip_high=0.3"], r"algorithm.clip_high: pg_seq_is does not use it .*grpo"),
        (["algorithm.name=grpo", "algorithm.delta=0.1"], r"algorithm.delta: grpo does not use it .*grpo_opsm"),
        (["algorithm.name=grpo_opsm", "algorithm.delta=-1"], r"algorithm.delta: must be > 0, got -1.0"),
        (["algorithm.name=sapo", "algorithm.clip_low=0.1"], r"algorithm.clip_low: sapo does not use it"),
        (["algorithm.name=dppo_kl", "algorithm.cap_low=0.5"], r"algorithm.cap_low: dppo_kl does not use it"),
        (["algorithm.name=sapo", "algorithm.aggregation=token_mean"], "sapo is defined per sequence"),
        (["task.name=length", "algorithm.truncated=zero_reward"], "longest responses"),
    ],
)
def test_algorithm_combinations_refused(keys, message):
    from parity.rl.train_config import TrainConfig

    with pytest.raises(ConfigError, match=message):
        config.load(TrainConfig, None, keys)


# ----------------------------------------------------------------------------- hostile config files and values


def _alias_bomb(levels: int = 9) -> str:
    """A YAML file whose aliases name 10**levels values under a real key (lora.targets) in a few lines."""
    lines = ["a0: &a0 [q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj, q_proj]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + f"\nlora:\n  targets: [{', '.join([f'*a{levels - 1}'] * 10)}]\n"


@pytest.mark.parametrize(
    ("write", "message"),
    [
        (lambda p: p.write_text(_alias_bomb()), "expands to more than 100,000 values"),
        (lambda p: p.write_text("steps: " + "[" * 100_000 + "]" * 100_000 + "\n"), "YAML nested more than 32 deep"),
        (lambda p: p.write_text("steps:\n  " + "- " * 50 + "1\n"), "YAML nested more than 32 deep"),
        (lambda p: p.write_bytes(b"steps: \xff\n"), "not UTF-8 text"),
    ],
    ids=["alias bomb under a real key", "nested 100,000 deep", "nested 50 deep", "not UTF-8"],
)
def test_a_hostile_config_file_is_one_line(tmp_path, capsys, write, message):
    from parity.cli import main

    path = tmp_path / "CONFIG.yaml"
    write(path)
    assert main(["train", str(path), f"run_dir={tmp_path / 'run'}"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and str(path) in lines[0] and message in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_a_config_file_of_3_gib_is_refused_unread(tmp_path, capsys):
    """One 3 GiB line (a sparse file: no disk is used) is refused from its size, not read."""
    import resource

    from parity.cli import main

    path = tmp_path / "CONFIG.yaml"
    with open(path, "wb") as f:
        f.write(b"steps: ")
        f.truncate(3 * 2**30)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert main(["train", str(path), f"run_dir={tmp_path / 'run'}"]) == 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 * 2**10  # KiB: under 100 MiB more
    assert "a config file holds at most 1,048,576" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_an_alias_bomb_in_an_override_is_one_line():
    from parity.rl.train_config import TrainConfig

    bomb = "&a [x, x, x, x, x, x, x, x, x, x]"
    value = "[" + ", ".join(["*a"] * 10) + "]"
    for _ in range(5):
        value = "[" + ", ".join([value] * 10) + "]" if len(value) < 10**5 else value
    with pytest.raises(ConfigError, match="override lora.targets: YAML expands to more than 100,000 values"):
        config.load(TrainConfig, None, [f"lora.targets=[{bomb}, {value}]"])


HUGE = [
    ("seed=18446744073709551616", "seed: expected an integer of at most 64 bits, got one of 65 bits"),
    ("seed=1180591620717411303424", "seed: expected an integer of at most 64 bits, got one of 71 bits"),
    ("seed=4294967296", "seed: must be in [0, 4294967295]"),
    ("seed=-1", "seed: must be in [0, 4294967295]"),
    (f"steps={10**21}", "steps: expected an integer of at most 64 bits, got one of 70 bits"),
    ("steps=1000000000000", "steps: must be in [1, 1,000,000]"),
    ("algorithm.ppo_epochs=1000000000", "algorithm.ppo_epochs: must be in [1, 100]"),
    ("rollout.max_new_tokens=1000000000000", "rollout.max_new_tokens=1000000000000: the model's max_position"),
    ("eval.max_new_tokens=1000000000000", "eval.max_new_tokens=1000000000000: the model's max_position"),
    ("lora.rank=100000", "lora.rank=100000: more than 64, the narrowest adapted projection's width"),
    ("rollout.group_size=1000000000", "prompts_per_step x rollout.group_size"),
    ("prompts_per_step=1000000000", "prompts_per_step x rollout.group_size"),
    ("diagnostics.full_vocab_positions=1000000000000", "diagnostics.full_vocab_positions"),
    ("task.num_problems=1000000000", "task.num_problems: must be in [1, 100,000]"),
    ("eval.num_prompts=1000000000", "eval.num_prompts: must be in [1, 100,000]"),
    ("eval.samples=1000000000", "eval.num_prompts x eval.samples"),
    ("distributed.threads=1000000", "distributed.threads: must be in [0, "),
    ("reward.timeout_s=1e300", "reward.timeout_s: must be in (0, 86400] seconds"),
    ("reward.timeout_s=1e10", "reward.timeout_s: must be in (0, 86400] seconds"),
    ("distributed.restart_timeout_s=1e300", "distributed.restart_timeout_s: must be in (0, 86400]"),
    ("distributed.connect_timeout_s=0", "distributed.connect_timeout_s: must be in (0, 86400]"),
]


@pytest.mark.parametrize(("override", "message"), HUGE, ids=[h[0][:40] for h in HUGE])
def test_a_value_the_machine_cannot_honour_is_refused_before_anything_is_written(override, message, tmp_path, capsys):
    """Values that passed validation and then crashed, hung or were killed for memory after the run started."""
    from parity.cli import main

    assert main(["train", f"run_dir={tmp_path / 'run'}", "steps=1", "tensorboard=false", override]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and message in lines[0], lines
    assert not (tmp_path / "run").exists()


COMMAND_HUGE = [
    (["eval", "builtin", "precisions=fp32", "num_prompts=1000000000"], "num_prompts: must be in [1, 100,000]"),
    (["eval", "builtin", "precisions=fp32", "samples=1000000000"], "num_prompts x samples, max_new_tokens: "),
    (["eval", "builtin", "seed=100000000000000000000000"], "seed: expected an integer of at most 64 bits"),
    (["eval", "builtin", "seed=-1"], "seed: must be in [0, 4294967295]"),
    (["mismatch", "num_prompts=1000000000"], "num_prompts: must be in [1, 100,000]"),
    (
        ["mismatch", "group_size=1000000000"],
        "num_prompts x group_size, sampling.max_new_tokens, full_vocab_positions: ",
    ),
    (["mismatch", "seed=100000000000"], "seed: must be in [0, 4294967295]"),
    (["perfectible", "num_candidates=1000000000"], "num_candidates: must be in [1, 100,000]"),
    (["perfectible", "samples=1000000000"], "batch_prompts x samples, max_new_tokens: "),
    (["perfectible", "batch_prompts=0"], "batch_prompts: must be >= 1, got 0"),
]


@pytest.mark.parametrize(("argv", "message"), COMMAND_HUGE, ids=[" ".join(h[0]) for h in COMMAND_HUGE])
def test_a_count_of_another_command_the_machine_cannot_honour_is_refused(argv, message, tmp_path, capsys):
    """The other commands' own counts: 10**9 prompts or candidates were generated for ever, 10**9 samples
    allocated, a batch of 0 prompts stepped by 0."""
    from parity.cli import main

    out = tmp_path / "out"
    where = [f"out={out / 'set.jsonl'}"] if argv[0] == "perfectible" else ["--out", str(out)]
    assert main([*argv, *where]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def _yaml_tags_safe_loading_refuses() -> list[str]:
    """A value under each tag PyYAML's unsafe loader builds and its safe one does not (`!!python/...`: objects,
    calls, names, modules), and a tag of nobody's."""
    import yaml

    safe = set(yaml.SafeLoader.yaml_constructors) | set(yaml.SafeLoader.yaml_multi_constructors)
    single = [t for t in yaml.UnsafeLoader.yaml_constructors if t not in safe and t is not None]
    multi = [f"{t}os.system" for t in yaml.UnsafeLoader.yaml_multi_constructors if t not in safe]
    return [f"!<{tag}> ['touch MARKER']" for tag in single + multi] + ["!local ['touch MARKER']"]


# Values the safe loader refuses to build, each in a file of valid YAML otherwise: the error used to be PyYAML's
# or Python's traceback, of no line.
BAD_VALUES = [
    *_yaml_tags_safe_loading_refuses(),
    "!!int abc",
    "!!float abc",
    "!!bool maybe",
    "!!timestamp 2001-13-45",
    "2001-13-45",  # read as a date, in a month that does not exist
    "!!omap [1]",
    "!!set [1]",
    "9" * 5000,  # past Python's 4,300 digits
    "1:" * 300_000 + "1",  # base 60, which PyYAML builds in quadratic time
    "0x" + "f" * 100,
]


@pytest.mark.parametrize("value", BAD_VALUES, ids=[v[:40] for v in BAD_VALUES])
def test_a_yaml_value_the_safe_loader_cannot_build_is_one_line(tmp_path, capsys, monkeypatch, value):
    from parity.cli import main

    monkeypatch.chdir(tmp_path)
    path = tmp_path / "CONFIG.yaml"
    path.write_text(f"precision: fp32\nsteps: {value}\n")
    assert main(["train", str(path), f"run_dir={tmp_path / 'run'}"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and f"{path}:2: " in lines[0], lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "MARKER").exists()
    # The same as an override is the text it is, which the key's type refuses
    assert main(["train", f"steps={value}", f"run_dir={tmp_path / 'run'}"]) == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("parity ")]
    assert len(lines) == 1 and "steps: expected an integer" in lines[0], lines
    assert not (tmp_path / "run").exists() and not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize(
    "text",
    ["steps: 3\n? [a, b]\n: 1\n", "a: &x 1\nb:\n  <<: *x\n", "a: 1\n---\nb: 2\n"],
    ids=["unhashable key", "merge of a scalar", "two documents"],
)
def test_yaml_the_safe_loader_cannot_map_is_one_line(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=rf"^{path}:\d+: (cannot load this YAML value|invalid YAML) \("):
        config.load(MismatchConfig, path)


@pytest.mark.parametrize(
    "text, message",
    [
        # YAML keeps a repeated key's last value: a second `rollout:` block dropped the first one's keys
        (
            "rollout:\n  group_size: 2\nsteps: 2\nrollout:\n  temperature: 0.5\n",
            "4: 'rollout' is given twice (first on line 1)",
        ),
        ("trainer:\n  lr: 1.0e-5\n  lr: 2.0e-5\n", "3: 'lr' is given twice (first on line 2)"),
        # a check after the type names the key in other words than `KEY: ...`: the line was lost
        ("steps: 2\nrollout:\n  top_p: 3\n", "3: rollout.top_p must be in (0, 1], got 3"),
        (
            "steps: 1:0\n",
            "1: cannot load this YAML value (1:0 is the base-60 number 60 to YAML 1.1; quote it",
        ),  # 60 steps
    ],
)
def test_a_config_file_s_value_that_would_mislead_is_refused_naming_its_line(tmp_path, text, message):
    from parity.rl.train_config import TrainConfig

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(f'{path}:{message}')}"):
        config.load(TrainConfig, path)


def test_a_section_override_adds_to_the_earlier_keys_of_its_section():
    """On the command line `rollout={...}` dropped an earlier `rollout.group_size=2`."""
    from parity.rl.train_config import TrainConfig

    cfg = config.load(TrainConfig, None, ["rollout.group_size=2", "rollout={temperature: 0.5}", "steps=3"])
    assert (cfg.rollout.group_size, cfg.rollout.temperature, cfg.steps) == (2, 0.5, 3)
    with pytest.raises(ConfigError, match="^steps: expected an integer, got '1:0'$"):
        config.load(TrainConfig, None, ["steps=1:0"])


def test_eval_refuses_weights_that_do_not_pair_with_its_reward_functions():
    """zip dropped the extra weights, and weights without functions were ignored."""
    from parity.commands.evaluate import EvalConfig

    for keys, count in (
        (["reward_fn=m:f", "reward_weights=[1,2]"], "2 weights for 1"),
        (["reward_weights=[1]"], "1 weights for 0"),
    ):
        with pytest.raises(ConfigError, match=f"^reward_weights: {count} reward functions"):
            config.load(EvalConfig, None, ["target=builtin", *keys])
