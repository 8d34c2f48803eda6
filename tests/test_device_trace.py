"""flint_jax.device_trace on a hand-written Perfetto trace: the GPU's stream kernels only, split into steps."""
import gzip
import json
import pytest

from flint_jax import device_trace


def write_trace(tmp_path, steps=3):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 2, "tid": 7, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 2, "tid": 8, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    ev = []
    t = 1000.0
    for _ in range(steps):
        for name, dur in (("qkv_projection", 7.5), ("attn", 11.0), ("moe_down", 7.0)):
            ev.append({"ph": "X", "pid": 2, "tid": 7, "name": name, "ts": t, "dur": dur})
            ev.append({"ph": "X", "pid": 2, "tid": 8, "name": name + " op", "ts": t, "dur": dur})  # op-level copy
            t += dur + 2.0  # 2 us launch gap inside the step
        ev.append({"ph": "X", "pid": 1, "tid": 1, "name": "PjitFunction(forward)", "ts": t, "dur": 900.0})
        t += 900.0  # host-bound gap between steps
    d = tmp_path / "plugins" / "profile" / "run"
    d.mkdir(parents=True)
    with gzip.open(d / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": meta + ev}, f)
    return str(tmp_path)


def test_reads_stream_kernels_and_step_spans(tmp_path):
    events = device_trace.read_kernel_events(write_trace(tmp_path))
    assert [e["name"] for e in events[:3]] == ["qkv_projection", "attn", "moe_down"]
    assert len(events) == 9  # the host event and the "XLA Ops" copies are not kernels
    spans = device_trace.step_spans(events, 3)
    # within a step: 7.5 + 2 + 11 + 2 + 7 us; the 900 us host gap between steps is not device time
    assert spans == [0.0295] * 3
    assert device_trace.device_ms(events, 3) == 0.0295
    table = device_trace.summarize(events, 3)
    assert table["launches_per_step"] == 3
    assert table["rows"][0]["name"] == "attn" and table["rows"][0]["us_per_step"] == 11.0
    assert table["step_busy_ms"] == [0.0255] * 3  # the kernels' 25.5 us; the 2 us launch gaps are idle


def test_busy_counts_overlapping_kernels_once():
    ev = [{"ts": 0.0, "dur": 10.0}, {"ts": 5.0, "dur": 20.0}, {"ts": 12.0, "dur": 1.0}, {"ts": 30.0, "dur": 1.0}]
    assert device_trace.busy_us(ev) == 26.0  # 0..25 and 30..31
    assert device_trace.busy_us(list(reversed(ev))) == 26.0
    assert device_trace.busy_us([]) == 0.0


def test_idle_gaps_are_attributed_to_the_kernel_that_ends_them(tmp_path):
    events = device_trace.read_kernel_events(write_trace(tmp_path))
    gaps = device_trace.idle_gaps(events, 3)
    # 2 us before attn and before moe_down in each step; the 900 us host gap between steps is not device idle time
    assert gaps["idle_us_per_step"] == 4.0
    assert {r["name"]: r["idle_us_per_step"] for r in gaps["rows"]} == {"attn": 2.0, "moe_down": 2.0}
    # an overlapping kernel (another stream) leaves no gap, and the gap after it starts at the later end
    ev = [{"name": "a", "ts": 0.0, "dur": 10.0}, {"name": "b", "ts": 5.0, "dur": 20.0},
          {"name": "c", "ts": 12.0, "dur": 1.0}, {"name": "d", "ts": 30.0, "dur": 1.0}]
    gaps = device_trace.idle_gaps(ev, 1)
    assert gaps["idle_us_per_step"] == 5.0 and gaps["rows"] == [
        {"name": "d", "gaps_per_step": 1.0, "idle_us_per_step": 5.0, "mean_us": 5.0}]


def test_longest_gap_and_what_the_host_did_meanwhile(tmp_path):
    trace = write_trace(tmp_path)
    events = device_trace.read_kernel_events(trace)
    # between the steps: from moe_down's end (1000 + 9.5 + 13 + 7 us) to the next qkv_projection (2 us launch gap
    # + the 900 us host event later); the three steps' gaps are equal and the first one is reported
    start, end = device_trace.longest_gap(events)
    assert (start, end) == (1029.5, 1931.5)
    host = device_trace.read_host_events(trace)
    assert [e["name"] for e in host] == ["PjitFunction(forward)"] * 3  # no kernels, no device op copies
    rows = device_trace.host_activity(host, start, end)
    # the first host event (1031.5 -> 1931.5) lies inside the gap; the other two do not overlap it
    assert rows == [{"name": "PjitFunction(forward)", "count": 1, "overlap_us": 900.0}]
    # clipped to the interval: 1031.5 -> 1129.5
    assert device_trace.host_activity(host, start, start + 100.0)[0]["overlap_us"] == 98.0
    assert device_trace.host_activity(host, 0.0, 1000.0) == []
    assert device_trace.longest_gap(events[:1]) is None
    assert device_trace.longest_gap([{"ts": 0.0, "dur": 5.0}, {"ts": 2.0, "dur": 1.0}]) is None


def test_steps_that_do_not_divide_give_no_spans(tmp_path):
    events = device_trace.read_kernel_events(write_trace(tmp_path))
    assert device_trace.step_spans(events, 4) == []
    assert device_trace.device_ms(events, 4) is None


def test_trace_call_is_none_without_device_events():
    """On the CPU a traced call has no device kernel events: trace_call says so instead of an empty summary."""
    import jax
    import jax.numpy as jnp
    from flint_jax import device_trace
    if jax.default_backend() != "cpu":
        pytest.skip("device events exist on this backend")
    assert device_trace.trace_call(lambda: jnp.ones(3) * 2) is None


def test_marker_periods_split_a_generate_trace_into_decode_steps(tmp_path):
    # write_trace's steps end with moe_down: 4 steps give 3 periods, the first dropped (skip=1). Each runs from one
    # moe_down's end to the next's: 2 + 900 us idle before qkv_projection, 2 before attn and before moe_down, and
    # 7.5 + 11 + 7 us of kernels
    events = device_trace.read_kernel_events(write_trace(tmp_path, steps=4))
    t = device_trace.marker_periods(events, "moe_down")
    assert t["periods"] == 2
    assert t["period_us"] == 931.5 and t["kernels"] == 3
    assert t["busy_us"] == 25.5 and t["idle_us"] == 906.0 and t["first_gap_us"] == 902.0
    assert {g["name"]: g["idle_us_per_period"] for g in t["gaps"]} == {"qkv_projection": 902.0, "attn": 2.0,
                                                                       "moe_down": 2.0}
    assert [r["name"] for r in t["rows"]] == ["attn", "qkv_projection", "moe_down"]
    assert t["rows"][0]["per_step"] == 1.0
    # overlapping kernels count once in the busy time
    ev = [{"name": "m", "ts": 0.0, "dur": 1.0}, {"name": "a", "ts": 2.0, "dur": 10.0},
          {"name": "b", "ts": 5.0, "dur": 10.0}, {"name": "m", "ts": 20.0, "dur": 1.0}]
    t = device_trace.marker_periods(ev, "m", skip=0)
    assert t["periods"] == 1 and t["busy_us"] == 14.0 and t["idle_us"] == 6.0 and t["kernels"] == 3
    assert t["first_gap_us"] == 1.0
    assert device_trace.marker_periods(ev[:2], "m") == {"periods": 0}


def test_per_layer_divides_a_step_by_its_layers(tmp_path):
    """A probe's program of 3 'layers' (the three kernels of write_trace): span per layer, kernels per layer, the
    kernels launched once per layer or more, and the bytes per layer over that time."""
    events = device_trace.read_kernel_events(write_trace(tmp_path))
    got = device_trace.per_layer(events, steps=3, layers=3, nbytes=29_500)
    assert got["device_us_per_layer"] == pytest.approx(29.5 / 3)
    assert got["kernels_per_layer"] == 1.0
    assert got["kernels"] == []  # each kernel runs once per step, i.e. a third of a time per layer
    assert got["GBps"] == pytest.approx(29_500 / (29.5e-6 / 3) / 1e9)
    one = device_trace.per_layer(events, steps=3, layers=1)
    assert sorted(k["name"] for k in one["kernels"]) == ["attn", "moe_down", "qkv_projection"]
    assert "GBps" not in one
