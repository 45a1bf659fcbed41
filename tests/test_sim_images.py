"""The vision encoder in the simulator: traces carry images (placeholder spans and a content id), the shared
scheduler's plan lists the images the step's encoder runs make, the latency model prices each by its patch
count from the bundle's vision_encoder.csv, and a request whose images hit the prefix cache pays nothing. No
torch: the bundle is hand-written (tests/test_sim.py), the profiler's side is tests/test_profile.py."""
from __future__ import annotations

import os

import pytest
from test_sim import MiB, cluster, synthetic_bundle

from deltaserve.sim import Simulation, load_bundle
from deltaserve.sim.bundle import write_table
from deltaserve.sim.latency import LatencyModel, StepShape
from deltaserve.sim.trace import TraceError, TraceRequest, parse_line

# one image of n tokens (4 patches each) costs 1,000 + 50 us per patch: 64 tokens 13.8 ms, 196 tokens 40.2 ms
ENCODER = [{"patches": 4 * n, "tokens": n, "time_us": 1000.0 + 50.0 * 4 * n, "p10_us": "", "p90_us": ""}
           for n in (16, 64, 256, 1024)]


def encoder_us(tokens: int) -> float:
    return 1000.0 + 50.0 * 4 * tokens


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(a bundle with the encoder table, the same without it)."""
    with_enc = synthetic_bundle(str(tmp_path_factory.mktemp("enc")))
    write_table(with_enc, "vision_encoder.csv", ENCODER)
    return load_bundle(with_enc), load_bundle(synthetic_bundle(str(tmp_path_factory.mktemp("noenc"))))


def test_latency_prices_each_encoded_image_by_its_patches(bundles):
    enc, plain = bundles
    lm = LatencyModel(enc)
    base = StepShape(prefill=[(300, 0)], decode_ctx=[], n_sample=1)
    one = StepShape(prefill=[(300, 0)], decode_ctx=[], n_sample=1, encoder_images=(196,))
    two = StepShape(prefill=[(300, 0)], decode_ctx=[], n_sample=1, encoder_images=(196, 40))
    assert lm.encoder_us(base) == 0.0
    assert lm.shape_us(one) - lm.shape_us(base) == pytest.approx(encoder_us(196))  # interpolated (64 .. 256)
    assert lm.shape_us(two) - lm.shape_us(base) == pytest.approx(encoder_us(196) + encoder_us(40))
    slow = LatencyModel(enc, wall_per_cpu=2.0)  # contention scales it with the rest of the step
    assert slow.shape_us(one) - slow.shape_us(base) == pytest.approx(2 * encoder_us(196))
    without = LatencyModel(plain)
    assert without.shape_us(base) == pytest.approx(lm.shape_us(base))  # a text step: the table changes nothing
    with pytest.raises(ValueError, match="vision_encoder.csv"):  # images without the table: no free encoder
        without.shape_us(one)


def test_trace_images_round_trip_and_refusals():
    line = {"request_id": "r", "arrival_time": 0.5, "prompt_token_ids": list(range(10, 310)), "output_length": 4,
            "images": [{"offset": 20, "tokens": 64, "id": "cat"}, {"offset": 100, "tokens": 16, "id": 7}]}
    r = parse_line(line, 0)
    assert r.images == [(20, 64, "cat"), (100, 16, "7")] and "images" not in r.extra
    assert parse_line(r.to_json(), 0).images == r.images
    same = parse_line(dict(line, images=[{"offset": 5, "tokens": 64, "id": "cat"}]), 0)
    other = parse_line(dict(line, images=[{"offset": 20, "tokens": 64, "id": "dog"}]), 0)
    assert same.media[0][2] == r.media[0][2] != other.media[0][2]  # the id names the content
    assert r.media[0][:2] == (20, 64) and len(r.media[0][2]) == 32
    assert "images" not in parse_line(dict(line, images=[]), 0).to_json()
    for bad in ([{"offset": 290, "tokens": 64, "id": "x"}],  # past the prompt
                [{"offset": 20, "tokens": 64, "id": "a"}, {"offset": 50, "tokens": 4, "id": "b"}],  # overlapping
                [{"offset": 20, "tokens": 0, "id": "a"}], [{"offset": 20, "id": "a"}], {"offset": 1}):
        with pytest.raises(TraceError, match="image"):
            parse_line(dict(line, images=bad), 0)


def _run(bundle, trace, **flags):
    sim = Simulation(cluster(bundle, **flags))
    plans = []
    sim.replicas[0].on_plan = lambda plan, now: plans.append((now, [w.request_id for w in plan.work],
                                                              plan.encoder_images))
    recs = {r.request_id: r for r in sim.run(trace)}
    sim.replicas[0].memory.check_integrity(deep=False)
    return recs, plans


def test_simulation_charges_the_encoder_once_and_not_on_a_hit(bundles):
    """The first chunk that reaches a request's images encodes all of them (the plan lists them once, however
    the prompt is chunked), its step takes the encoder's time; the same picture again hits the prefix cache past
    it and encodes nothing; another picture at the same place encodes again and hits only before it."""
    enc, plain = bundles
    ids = list(range(10, 1010))
    img = lambda key: [{"offset": 300, "tokens": 196, "id": key}, {"offset": 600, "tokens": 64, "id": key + "2"}]
    trace = [parse_line({"request_id": rid, "arrival_time": t, "prompt_token_ids": ids, "output_length": 2,
                         "images": img(key)}, k)
             for k, (rid, t, key) in enumerate((("a", 0.0, "cat"), ("b", 10.0, "cat"), ("c", 20.0, "dog")))]
    recs, plans = _run(enc, trace, max_num_batched_tokens=256)
    encoded = [(who, images) for _, who, images in plans if images]
    assert encoded == [(["a"], (196, 64)), (["c"], (196, 64))]  # once for a (its chunk at 256 reaches 300), once for c
    assert recs["b"].cached_tokens >= 896 and recs["c"].cached_tokens <= 256  # c hits only the blocks before 300
    text = [TraceRequest(r.request_id, r.arrival_time, r.output_length, prompt_token_ids=ids) for r in trace]
    plain_recs, _ = _run(plain, text, max_num_batched_tokens=256)
    ttft = lambda rs, rid: rs[rid].first_token - rs[rid].arrival
    extra = encoder_us(196) + encoder_us(64)
    assert ttft(recs, "a") - ttft(plain_recs, "a") == pytest.approx(extra * 1e-6, rel=1e-6)
    assert ttft(recs, "c") - ttft(plain_recs, "c") > extra * 1e-6  # encodes again, and hits less than text did
    assert ttft(recs, "b") < ttft(recs, "a") - extra * 1e-6


def test_the_real_engine_replay_refuses_images():
    from deltaserve.tools.validate.real import run_real

    r = TraceRequest("a", 0.0, 2, prompt_token_ids=list(range(10, 400)), images=[(20, 64, "cat")])
    with pytest.raises(ValueError, match="no pixels"):
        run_real("tiny", {"kv_cache_memory": 64 * MiB}, True, [r], [], None, probe="before")


def test_encoder_table_is_in_the_bundle_format(tmp_path):
    path = synthetic_bundle(str(tmp_path / "b"))
    write_table(path, "vision_encoder.csv", ENCODER)
    assert os.path.exists(os.path.join(path, "vision_encoder.csv"))
    assert load_bundle(path).rows("vision_encoder.csv")[1] == {"patches": 256, "tokens": 64, "time_us": 13800.0,
                                                               "p10_us": "", "p90_us": ""}


def test_prefix_affinity_credits_a_replica_with_the_images_it_holds(bundles):
    """The router's probe keys image blocks as the scheduler does: the replica that served a picture is credited
    with the blocks past it for the same picture, and only with those before it for another one."""
    from deltaserve.scheduler import Request
    from deltaserve.sim.router import PrefixAffinity

    enc, _ = bundles
    ids = list(range(10, 1010))
    sim = Simulation(cluster(enc, n=2, router="prefix-affinity", max_num_batched_tokens=256))
    first = parse_line({"request_id": "a", "arrival_time": 0.0, "prompt_token_ids": ids, "output_length": 2,
                        "images": [{"offset": 300, "tokens": 196, "id": "cat"}]}, 0)
    rec = sim.run([first])[0]
    rep = sim.replicas[rec.replica]

    def credited(key: str) -> int:
        media = parse_line({"arrival_time": 0, "prompt_token_ids": ids, "output_length": 1,
                            "images": [{"offset": 300, "tokens": 196, "id": key}]}, 0).media
        return PrefixAffinity._hit_tokens(Request("p", ids, max_tokens=1, media=media), rep, {})

    assert credited("cat") >= 896 and credited("dog") <= 256
