"""benchmarks/common.py's round order and what measure() records about it (CPU, no timing claims)."""

import pathlib
import sys

import jax.numpy as jnp

sys.path.insert(0, str(pathlib.Path(__file__).parents[1] / "benchmarks"))

import common  # noqa: E402


def test_rotation_is_the_default_order():
    items = list("abcd")
    assert [common.round_order(items, r) for r in range(5)] == [
        list("abcd"), list("bcda"), list("cdab"), list("dabc"), list("abcd")]


def test_shuffle_keeps_each_rounds_first_item_and_varies_the_rest():
    items = list("abcdef")
    orders = [common.round_order(items, r, shuffle=True) for r in range(12)]
    for r, o in enumerate(orders):
        assert o[0] == items[r % len(items)] and sorted(o) == items
        assert o == common.round_order(items, r, shuffle=True)       # seeded: the same every run
    # under the rotation "b" always follows "a"; shuffled rounds give it other neighbours
    before_b = {o[o.index("b") - 1] for o in orders if o[0] != "b"}
    assert len(before_b) > 1
    assert common.round_order(list("ab"), 1, shuffle=True) == list("ba")   # two items: nothing to shuffle


def test_measure_records_each_rounds_predecessor():
    impls = [common.Impl(name, lambda a, s=s: a * s) for name, s in (("x", 1.0), ("y", 2.0), ("z", 3.0))]
    recs = common.measure("t", "t", "case", impls, lambda seed: (jnp.full((4,), float(seed + 1)),), 0.0,
                          rounds=4, warmup=1, target_s=1e-4, check=False, shuffle=True)
    for rec in recs:
        assert len(rec["rounds_after"]) == len(rec["rounds_ms"]) == 4
    for r in range(4):
        order = [impls[i].name for i in common.round_order(range(3), r, shuffle=True)]
        for pos, name in enumerate(order):
            rec = next(x for x in recs if x["impl"] == name)
            assert rec["rounds_after"][r] == (order[pos - 1] if pos else None)


def test_in_loop_feeds_each_product_back():
    # the kernel-level timing of small products: every iteration's product depends on the
    # previous one's (one element written back), so XLA can neither hoist nor drop it
    import bench_matmul
    a = jnp.arange(6.0).reshape(2, 3)
    b = jnp.full((3, 2), 0.5)
    want = a
    for _ in range(3):
        want = want.at[0, 0].set((want @ b)[0, 0])
    assert (bench_matmul.in_loop(jnp.matmul, 3)(a, b) == want).all()


def test_scaling_table_divides_each_implementation_by_its_own_one_gpu_rate():
    import run

    rec = lambda impl, n, tps: {"table": "scaling", "impl": impl, "devices": n, "moe": False,  # noqa: E731
                                "case": f"dense, {n} GPUs", "tokens_per_s_per_device": tps}
    lines = run.scaling_table([rec("jax_cute", 1, 200.0), rec("xla", 1, 100.0), rec("jax_cute", 4, 180.0),
                               rec("xla", 4, 95.0)])
    assert lines[2] == "| case | jax_cute | XLA |"
    assert lines[4] == "| dense, 4 GPUs | 0.900 | 0.950 |"
    assert run.scaling_table([rec("jax_cute", 4, 180.0)]) == []  # no one-GPU rate: no table
    # the suite's own labels; a variant measured on several GPUs only, against jax_cute's one-GPU rate
    lines = run.scaling_table([rec("jax_cute", 1, 200.0), rec("jax_cute", 4, 180.0),
                               rec("jax_cute_float32_sums", 4, 170.0)], run.SUITE_LABELS["scaling"])
    assert lines[2] == "| case | jax_cute | jax_cute, float32 sums over GPUs |"
    assert lines[4] == "| dense, 4 GPUs | 0.900 | 0.850 |"


def test_summary_is_the_geometric_mean_over_cases_where_jax_cute_ran_its_kernel(tmp_path):
    import json

    import run

    rec = lambda case, impl, tf, **kw: {"table": "gemm", "case": case, "impl": impl, "tflops": tf, **kw}  # noqa: E731
    data = {"device": "GPU X", "date": "2026-01-02T03:04:05", "suites": ["matmul"], "records": [
        rec("a", "jax_cute", 200.0), rec("a", "xla", 100.0),
        rec("b", "jax_cute", 50.0), rec("b", "xla", 100.0),
        rec("c", "jax_cute", 900.0, kernel=False), rec("c", "xla", 100.0),   # fell back: not ours
        rec("d", "jax_cute", 100.0), rec("d", "xla", None, error="boom")]}  # the rival failed
    path = tmp_path / "r.json"
    path.write_text(json.dumps(data))
    assert run.summary([str(path)]) == [
        "- **Dense GEMM** (GPU X, 2026-01-02): jax_cute 1.00x XLA (0.50-2.00x, 2 cases)."]


def test_a_file_of_tables_with_one_story_takes_its_title_and_note(tmp_path):
    """The weight-gradient tables (dense and ragged-K) come from the fp8 suite without its GEMMs:
    their section is their own, not the suite's DeepGEMM-shapes one."""
    import json

    import run

    rec = lambda table, impl, tf: {"table": table, "case": "c", "impl": impl, "tflops": tf}  # noqa: E731
    data = {"device": "GPU X", "date": "2026-01-02T03:04:05", "suites": ["fp8"], "records": [
        rec("fp8_wgrad", "jax_cute", 120.0), rec("fp8_wgrad", "jax_cute_bf16", 100.0),
        rec("fp8_wgrad_grouped", "jax_cute", 110.0), rec("fp8_wgrad_grouped", "jax_cute_bf16", 100.0)]}
    path = tmp_path / "wgrad.json"
    path.write_text(json.dumps(data))
    title, note = run.TABLE_SECTION["fp8_wgrad"]
    text = run.report([str(path)], str(tmp_path / "B.md"), str(tmp_path / "plots"))
    assert f"## {title}\n" in text and note in text and run.SUITE_TITLE["fp8"] not in text
    assert run.summary([str(path)]) == [
        f"- **{title}, dense** (GPU X, 2026-01-02): jax_cute 1.20x jax_cute bf16 (1 case).",
        f"- **{title}, ragged-K** (GPU X, 2026-01-02): jax_cute 1.10x jax_cute bf16 (1 case)."]
    # tables of different stories (or none) keep the suite's section
    assert run.own_section(["fp8_wgrad", "fp8_swiglu"]) is None and run.own_section(["gemm"]) is None


def test_merged_cases_replace_their_records_and_carry_their_own_date(tmp_path):
    import json

    import pytest
    import run

    rec = lambda case, impl, tf: {"table": "gemm", "case": case, "impl": impl, "tflops": tf}  # noqa: E731
    head = {"device": "GPU X", "jax_version": "0.1", "suites": ["matmul"]}
    into, new = tmp_path / "into.json", tmp_path / "new.json"
    into.write_text(json.dumps({**head, "date": "2026-01-02T00:00", "records": [
        rec("a", "jax_cute", 100.0), rec("a", "xla", 100.0), rec("b", "jax_cute", 100.0), rec("b", "xla", 100.0)]}))
    new.write_text(json.dumps({**head, "date": "2026-01-05T00:00", "commit": "abc", "cases": "^b",
                               "records": [rec("b", "jax_cute", 300.0), rec("b", "xla", 100.0)]}))
    data = run.merge(str(into), str(new), "case b")
    assert sorted((r["case"], r["tflops"]) for r in data["records"]) == [("a", 100.0), ("a", 100.0), ("b", 100.0),
                                                                          ("b", 300.0)]
    assert data["merged"] == [{"label": "case b", "date": "2026-01-05T00:00", "commit": "abc", "cases": ["b"]}]
    assert "2026-01-02, case b on 2026-01-05 (jax 0.1)" in run._provenance(data, str(into))
    assert run.summary([str(into)]) == [
        "- **Dense GEMM** (GPU X, 2026-01-02 and 2026-01-05): jax_cute 1.73x XLA (1.00-3.00x, 2 cases)."]
    # a run on another device is not merged into the table
    new.write_text(json.dumps({**head, "device": "GPU Y", "records": []}))
    with pytest.raises(SystemExit, match="GPU Y"):
        run.merge(str(into), str(new), "case b")


def test_the_readme_quotes_the_summary_of_the_committed_results():
    import run

    root = pathlib.Path(__file__).parents[1]
    files = run.report_order([str(p) for p in (root / "benchmarks" / "results").iterdir()])
    readme = (root / "README.md").read_text()
    assert readme == run.readme_with_summary(readme, run.summary(files)), (
        "README.md's results summary is stale: run python benchmarks/run.py --report benchmarks/results/*")


def test_the_readme_stays_a_front_page():
    """At most 250 lines: the details live in docs/, the figures in BENCHMARKS.md."""
    lines = (pathlib.Path(__file__).parents[1] / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail to docs/"
