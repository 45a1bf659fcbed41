"""Every engine flag is defined once (config.EngineConfig) and parses the same in every command."""
import json

import pytest

from deltaserve.config import (ENGINE_DEFAULTS, ENGINE_FLAGS, REPLICA_FLAGS, ConfigError, EngineConfig,
                               SpeculativeConfig, engine_args)

# one value per flag, as a user types it, and what every command must make of it
SAMPLES = {
    "model": ("/ckpt/Qwen3.5-0.8B", "/ckpt/Qwen3.5-0.8B"),
    "revision": ("v1.0", "v1.0"),
    "tokenizer": ("Qwen/Qwen3.5-4B", "Qwen/Qwen3.5-4B"),
    "preset": ("qwen3.5-0.8b-shape", "qwen3.5-0.8b-shape"),
    "dtype": ("float32", "float32"),
    "max_model_len": ("32k", 32_000),
    "max_num_seqs": ("4", 4),
    "max_num_batched_tokens": ("512", 512),
    "prefill_merge_tokens": ("0", 0),
    "kv_cache_memory": ("2G", 2 << 30),
    "memory_utilization": ("0.3", 0.3),
    "block_size": ("64", 64),
    "enable_prefix_caching": (None, False),  # --no-enable-prefix-caching
    "cache_layout": ("in-page", "in-page"),
    "checkpoint_grid": ("512", 512),
    "resume_points": ("8", 8),
    "resume_point_bytes": ("1G", 1 << 30),
    "reprefill_outputs": (None, False),  # --no-reprefill-outputs
    "reprefill_job_tokens": ("512", 512),
    "strict_max_tokens": (True, True),  # --strict-max-tokens
    "max_output_tokens": ("64", 64),
    "eviction": ("value", "value"),
    "cache_disk": ("/var/cache/deltaserve", "/var/cache/deltaserve"),
    "cache_disk_bytes": ("2G", 2 << 30),
    "max_num_encoder_input_tokens": ("4096", 4096),
    "limit_mm_per_prompt": ('{"image": 4, "video": 0}', (("audio", 0), ("image", 4), ("video", 0))),
    "mm_processor_cache_gb": ("0.5", 0.5),
    "seed": ("3", 3),
    "num_threads": ("1", 1),
    "device": ("cpu", "cpu"),
    "cpu_isa": ("avx2", "avx2"),
    "quantize_head": ("fp8", "fp8"),
    "quantize": ("int4", "int4"),
    "tensor_parallel_size": ("2", 2),
    "nnodes": ("1", 1),
    "node_rank": ("0", 0),
    "master_addr": ("10.0.0.1", "10.0.0.1"),
    "master_port": ("29500", 29500),
    "distributed_timeout": ("30", 30.0),
    "speculative_config": ('{"method": "mtp", "num_speculative_tokens": 2}', SpeculativeConfig("mtp", 2)),
}


def _parsers():
    from deltaserve.bench.agent import build_parser as agent_parser
    from deltaserve.bench.throughput import build_parser as throughput_parser
    from deltaserve.cli import generate_parser
    from deltaserve.profile import build_parser as profile_parser
    from deltaserve.server.cli import make_parser as serve_parser
    from deltaserve.sim import build_parser as simulate_parser

    # command: (its parser, the arguments it requires, the engine flags it takes)
    return {
        "generate": (generate_parser(), ["--prompt", "hi"], tuple(ENGINE_FLAGS)),
        "serve": (serve_parser(), [], tuple(ENGINE_FLAGS)),
        "profile": (profile_parser(), ["--out", "b"], tuple(ENGINE_FLAGS)),
        "simulate": (simulate_parser(), ["--trace", "t", "--output", "o"], REPLICA_FLAGS),
        "bench agent": (agent_parser(), [], ("model", "preset", "seed", "kv_cache_memory", "max_num_batched_tokens",
                                            "max_num_seqs")),
        "bench throughput": (throughput_parser(), [], ("kv_cache_memory", "max_num_batched_tokens")),
    }


def test_samples_cover_every_flag():
    assert set(SAMPLES) == set(ENGINE_FLAGS)
    assert set(REPLICA_FLAGS) < set(ENGINE_FLAGS) and "model" not in REPLICA_FLAGS


@pytest.mark.parametrize("command", list(_parsers()))
def test_every_flag_parses_the_same_in_every_command(command):
    parser, required, takes = _parsers()[command]
    assert engine_args(parser.parse_args(required)) == {}, "a flag not given must leave EngineConfig's default"
    offered = {a.dest for a in parser._actions if a.dest in ENGINE_FLAGS}
    assert offered == set(takes), f"{command} offers {sorted(offered)}"
    for name in takes:
        text, want = SAMPLES[name]
        opt = ENGINE_FLAGS[name].option(name)
        argv = required + ([f"--no-{opt[2:]}"] if text is None else [opt] if text is True else [opt, text])
        got = engine_args(parser.parse_args(argv))
        assert got == {name: want}, (command, name, got)
        assert getattr(EngineConfig.from_kwargs(**got), name) == want


def test_kv_cache_memory_sizes():
    from deltaserve.config import parse_bytes

    assert [parse_bytes(x) for x in ("4294967296", "4G", "4GiB", "512M", "512MiB", "20GB", "1.5e9")] == \
        [4 << 30, 4 << 30, 4 << 30, 512 << 20, 512 << 20, 20 * 10**9, 1_500_000_000]
    for bad in ("lots", "4Q", "Gi", "-3G"):
        with pytest.raises(Exception):
            parse_bytes(bad)


def test_bad_values_are_refused_with_the_flag_named():
    for kw, flag in ((dict(max_num_seqs=0), "--max-num-seqs"), (dict(cache_layout="sideways"), "--cache-layout"),
                     (dict(num_threads=0), "--num-threads"), (dict(kv_cache_memory=-1), "--kv-cache-memory")):
        with pytest.raises(ConfigError, match=flag):
            EngineConfig.from_kwargs(**kw)
    with pytest.raises(ConfigError, match="unknown EngineConfig option"):
        EngineConfig.from_kwargs(max_num_seq=4)


def test_simulate_flags_override_every_replica(tmp_path):
    from deltaserve.sim import build_parser, cluster_from_args

    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"profile": "b", "replicas": [{"count": 2, "max_num_seqs": 8, "block_size": 128}]}))
    a = build_parser().parse_args(["--cluster-config", str(cfg), "--trace", "t", "--output", "o",
                                   "--max-num-seqs", "4", "--kv-cache-memory", "64M"])
    reps = cluster_from_args(a).replicas
    assert len(reps) == 2 and all(r.engine.max_num_seqs == 4 and r.engine.kv_cache_memory == 64 << 20
                                  and r.engine.block_size == 128 for r in reps)
    one = cluster_from_args(build_parser().parse_args(["--profile", "b", "--trace", "t", "--output", "o"]))
    assert [r.engine for r in one.replicas] == [EngineConfig()] and one.profile == "b"
    with pytest.raises(ConfigError, match="--profile"):
        cluster_from_args(build_parser().parse_args(["--trace", "t", "--output", "o"]))


def test_cluster_config_checks_replica_flags_as_the_engine_does():
    from deltaserve.sim.cluster import ReplicaConfig

    assert ReplicaConfig.from_dict({"max_num_seqs": 4, "tp": 2}).engine.max_num_seqs == 4
    with pytest.raises(ValueError, match="unknown replica option"):
        ReplicaConfig.from_dict({"model": "/x"})  # a replica's model is its bundle's
    with pytest.raises(ConfigError, match="--max-num-seqs"):
        ReplicaConfig.from_dict({"max_num_seqs": 0})


def test_defaults_agree_everywhere():
    from deltaserve.tools.planner import build_parser as plan_parser
    from deltaserve.sim.cluster import ReplicaConfig

    assert ENGINE_DEFAULTS["cache_layout"] == "runs"
    assert plan_parser().parse_args([]).layout == ENGINE_DEFAULTS["cache_layout"]
    assert ReplicaConfig().engine == EngineConfig()


def test_speculative_config_is_vllms_json_and_refuses_unknown_keys():
    assert EngineConfig(speculative_config={"method": "mtp", "num_speculative_tokens": 3}).speculative_config == \
        SpeculativeConfig("mtp", 3)
    assert EngineConfig().speculative_config is None
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3, "adaptive": false}').adaptive is False
    assert SpeculativeConfig.parse('{"num_speculative_tokens": 3}').adaptive is True
    for bad, match in (('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                       ('{"method": "mtp", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                       ('{"method": "mtp", "adaptive": "no"}', "adaptive"),
                       ('{"method": "mtp", "num_speculative_tokens": 2, "draft_tp": 1}', "unknown key"),
                       ("mtp", "not a JSON object")):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(speculative_config=bad)


def test_limit_mm_per_prompt_spellings():
    from deltaserve.config import parse_mm_limits

    assert parse_mm_limits('{"image": 16, "video": 0}') == parse_mm_limits("image=16,video=0") \
        == (("audio", 0), ("image", 16), ("video", 0))
    assert EngineConfig(limit_mm_per_prompt={"image": 2}).mm_limit("image") == 2
    assert EngineConfig().mm_limit("image") == 16 and EngineConfig().mm_limit("video") == 0
    for bad in ('{"video": 2}', '{"image": -1}', '{"pictures": 1}', "[1]", "image=x"):
        with pytest.raises(ConfigError):
            EngineConfig(limit_mm_per_prompt=bad)


def test_mm_processor_cache_gb_is_a_size():
    assert EngineConfig().mm_processor_cache_gb == 1.0 and EngineConfig(mm_processor_cache_gb=0).mm_processor_cache_gb == 0
    for bad in (-1, float("nan")):
        with pytest.raises(ConfigError, match="mm-processor-cache-gb"):
            EngineConfig(mm_processor_cache_gb=bad)


def test_every_flag_is_mirrored_by_a_deltaserve_variable():
    from deltaserve.config import env_engine_args, env_var

    assert env_var("max_model_len") == "DELTASERVE_MAX_MODEL_LEN"
    for name, (text, want) in SAMPLES.items():
        env = {env_var(name): "0" if text is None else "1" if text is True else text}
        assert env_engine_args(env) == {name: want}, name
    assert env_engine_args({}) == {} and env_engine_args({"DELTASERVE_HOME": "/x", "DELTASERVE_SEED": ""}) == {}
    for var, bad in (("DELTASERVE_MAX_MODEL_LEN", "lots"), ("DELTASERVE_CACHE_LAYOUT", "flat"),
                     ("DELTASERVE_ENABLE_PREFIX_CACHING", "maybe")):
        with pytest.raises(ConfigError, match=var):
            env_engine_args({var: bad})


def test_serve_takes_variables_under_its_flags(monkeypatch):
    from deltaserve.server.cli import engine_config_from_args, make_parser

    monkeypatch.setenv("DELTASERVE_MAX_NUM_SEQS", "8")
    monkeypatch.setenv("DELTASERVE_MAX_MODEL_LEN", "32k")
    monkeypatch.setenv("DELTASERVE_MODEL", "/env/model")
    monkeypatch.setenv("DELTASERVE_PORT", "9001")
    args = make_parser().parse_args(["/cli/model", "--max-num-seqs", "4"])
    cfg = engine_config_from_args(args)
    assert (cfg.max_num_seqs, cfg.max_model_len, cfg.model, args.port) == (4, 32_000, "/cli/model", 9001)
    assert engine_config_from_args(make_parser().parse_args([])).model == "/env/model"


def test_engine_argv_gives_serve_the_values_an_in_process_arm_takes():
    """config.engine_argv: the flags a benchmark passes to `deltaserve serve` for an arm it also runs in-process
    parse back to the same values (every sample value, booleans both ways, None left at the default)."""
    from deltaserve.config import engine_argv
    from deltaserve.server.cli import make_parser

    parse = make_parser().parse_args
    kwargs = {name: want for name, (_, want) in SAMPLES.items()
              if name not in ("speculative_config", "tensor_parallel_size", "nnodes")}  # their own checks
    kwargs["strict_max_tokens"] = True
    assert engine_args(parse(engine_argv(kwargs))) == kwargs
    assert engine_argv({"enable_prefix_caching": True, "seed": None}) == ["--enable-prefix-caching"]
    with pytest.raises(KeyError):
        engine_argv({"not_a_flag": 1})


@pytest.mark.parametrize("argv", [[c] for c in ("serve", "generate", "make-model", "doctor", "plan", "profile",
                                               "simulate")]
                         + [["bench", s] for s in __import__("deltaserve.bench", fromlist=["x"]).SUBCOMMANDS]
                         + [["simulate", "validate"]])
def test_every_command_prints_its_help(argv, capsys):
    """--help of every command and subcommand prints its usage and exits 0 (a help string is %-formatted by
    argparse: a bare % in one is a traceback where the user asked what the flags are)."""
    from deltaserve.cli import main

    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage:" in capsys.readouterr().out
