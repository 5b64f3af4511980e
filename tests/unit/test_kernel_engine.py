"""The kernel engine never takes the package down, says what it chose, and runs each of its
variants on one machine (docs/kernels.md). Each case that depends on the environment at import
runs in a fresh interpreter: a read-only numba cache and HOME, numba missing, the kernels
disabled, a forced product path, a forced ISA variant, and numba targets this CPU is not."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from aiayn.errors import ConfigError
from aiayn.model import kernels

SRC = Path(__file__).resolve().parents[2] / "src"
UNIT = Path(__file__).resolve().parent
# every variable that changes what the kernels do, cleared for each child
OURS = ("AIAYN_NO_KERNELS", "AIAYN_FORCE_ISA", "AIAYN_INT8_PRODUCT", "AIAYN_VERBOSE")


def run(code: str, env: dict[str, str] | None = None, path: tuple[Path, ...] = (SRC,),
        drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter with aiayn from ``path`` (and tests/unit, for this
    module's helpers), the kernels' variables cleared, then ``env`` set, ``drop`` unset."""
    child = {k: v for k, v in os.environ.items() if k not in OURS + drop}
    child.update(env or {})
    child["PYTHONPATH"] = os.pathsep.join(str(p) for p in (*path, UNIT))
    child["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-c", code], env=child, capture_output=True,
                          text=True, timeout=600)


def said(result: subprocess.CompletedProcess) -> list[str]:
    """The child's ``aiayn.kernels`` lines on stderr."""
    return [line for line in result.stderr.splitlines() if line.startswith("aiayn.kernels:")]


def int8_model():
    """An int8 copy of the search tests' tiny model, with peaked next-token distributions."""
    from test_search import tiny_model

    from aiayn.model.quantize import quantize_int8

    m = tiny_model(60, seed=3)
    with torch.no_grad():
        m.tgt_embed.weight.mul_(4.0)
    return quantize_int8(m)


def greedy(model) -> str:
    """Greedy search over the search tests' four sources: each output's tokens and its
    log-probability's float bits, as JSON (equal strings: the same outputs bit for bit)."""
    from test_search import SOURCES, encode_src

    from aiayn.decoding import CachedStep, greedy_search

    with torch.no_grad():
        step = CachedStep.start(model, *encode_src(model, SOURCES), 13)
        hyps = greedy_search(step, torch.tensor([9, 4, 12, 6]))
    return json.dumps([[list(map(int, h.tokens)), float(h.log_prob).hex()] for h in hyps])


# what every child below runs: an int8 copy decoded with greedy search
DECODE = "import test_kernel_engine as t; print(t.greedy(t.int8_model()))"


@pytest.fixture(scope="module")
def unwritable(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A copy of src/ where numba can write no cache, even as root: each package's
    ``__pycache__`` is a file (numba's in-tree cache cannot be made) and HOME lies under a file
    (nor its user-wide one), with no NUMBA_CACHE_DIR; what a read-only install with a
    read-only HOME gives (a container as nobody, Nix). The (src, environment) pair."""
    root = tmp_path_factory.mktemp("unwritable")
    src = root / "src"
    shutil.copytree(SRC / "aiayn", src / "aiayn", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in [p for p in src.rglob("*") if p.is_dir()]:
        (folder / "__pycache__").touch()
    (root / "home").touch()
    return src, {"HOME": str(root / "home" / "user"), "PYTHONDONTWRITEBYTECODE": "1"}


NO_CACHE = ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")


@pytest.mark.slow
def test_without_a_writable_cache_the_kernels_compile_in_memory_with_one_warning(unwritable):
    """numba itself cannot cache there (the simulation really fails: at a769b7b, ``import
    aiayn.model`` raised "cannot cache function '_prefetch_rows': no locator available", with
    and without AIAYN_NO_KERNELS=1); aiayn imports, compiles a kernel in memory and gives
    torch's numbers, saying so in one line."""
    src, env = unwritable
    code = """
import numba, torch
from aiayn.model import kernels
from aiayn.model.kernels import cpu
try:
    numba.njit(cache=True)(cpu.forced_isa)
    print("numba could cache")
except RuntimeError as error:
    assert "no locator available" in str(error)
assert kernels.AVAILABLE and kernels.ready("embed")
w, tok, pos = torch.randn(5, 8), torch.tensor([[1, 4]]), torch.randn(2, 8)
with torch.no_grad():
    assert torch.equal(kernels.embed(w, tok, 2.0, pos), w[tok] * 2.0 + pos)
print("ok", kernels.build_record()["kernel_cache"])
"""
    result = run(code, env, path=(src,), drop=NO_CACHE)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok", "memory"], result.stdout
    lines = said(result)
    assert len(lines) == 1 and "no writable numba cache" in lines[0], result.stderr


@pytest.fixture(scope="module")
def no_kernels(unwritable) -> subprocess.CompletedProcess:
    """The int8 decode with AIAYN_NO_KERNELS=1, in the unwritable tree, numba asserted never
    imported: torch's path, which the two tests below read (one child process for both)."""
    src, env = unwritable
    code = DECODE + "; import sys; assert 'numba' not in sys.modules, 'numba imported'"
    return run(code, {**env, "AIAYN_NO_KERNELS": "1"}, path=(src,), drop=NO_CACHE)


@pytest.mark.slow
def test_no_kernels_never_imports_numba_and_decodes_through_torch(no_kernels):
    """AIAYN_NO_KERNELS=1, in the same unwritable tree: numba is never imported, and an int8
    copy decodes through torch's ops, silently."""
    assert no_kernels.returncode == 0, no_kernels.stderr
    assert json.loads(no_kernels.stdout) and said(no_kernels) == []


@pytest.mark.slow
def test_without_numba_the_package_imports_and_decodes_through_torch(tmp_path, no_kernels):
    """numba not installed (a sitecustomize makes ``import numba`` fail): one warning, no
    kernel family enabled, and the same tokens as with AIAYN_NO_KERNELS=1 (the child of
    :func:`no_kernels`: the same source, copied)."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['numba'] = None\n")
    code = DECODE + "; from aiayn.model import kernels; assert not kernels.ENABLED"
    absent = run(code, path=(tmp_path, SRC))
    assert absent.returncode == 0, absent.stderr
    lines = said(absent)
    assert len(lines) == 1 and "numba could not be imported" in lines[0], absent.stderr
    assert no_kernels.returncode == 0, no_kernels.stderr
    assert absent.stdout == no_kernels.stdout


@pytest.mark.slow
def test_every_forced_product_path_gives_the_same_tokens_and_says_so():
    """AIAYN_INT8_PRODUCT forces one path for every map and row count (each checked exact on
    its shape first); AIAYN_VERBOSE=kernels logs each map's plan. Every path gives the same
    outputs bit for bit, in one process."""
    code = """
import os
import test_kernel_engine as t
from aiayn.model.quantize import PRODUCT_PATHS, Int8Linear
out = set()
for path in PRODUCT_PATHS:
    os.environ["AIAYN_INT8_PRODUCT"] = path
    q = t.int8_model()
    plans = {m.plan for m in q.modules() if isinstance(m, Int8Linear)}
    assert plans == ({None} if path == "int_mm" else {((1 << 62, path),)}), (path, plans)
    out.add(t.greedy(q))
assert len(out) == 1, out
print(len(PRODUCT_PATHS))
"""
    result = run(code, {"AIAYN_VERBOSE": "kernels"})
    assert result.returncode == 0, result.stderr
    maps = [line for line in said(result) if "int8 map" in line]
    for path in ("int_mm", "onednn", "fbgemm", "u8s8"):
        assert any(line.endswith(f"{path} at every row count") or f"{path} (" in line
                   for line in maps), (path, maps)


#: a numba cache folder that ``quantize.warm_up()`` alone filled (.ci/run's kernel lane sets it)
WARMED = "AIAYN_WARMED_NUMBA_CACHE"


@pytest.mark.slow
def test_warm_up_compiles_every_kernel_a_decode_then_runs(tmp_path):
    """``quantize.warm_up()`` (what scripts/test.sh and .ci/run run before the tests, and a
    container build may run) leaves nothing for a decode to compile: over a copy of a numba
    cache that warm_up() alone filled, a process decodes the tiny model greedily in fp32 and
    in int8 and finds every kernel it calls there (no dispatcher of the kernel package counts
    a cache miss). Found this way: the bfloat16 encoder keys of an int8 copy's
    cross-attention step were compiled at first use. Filling an empty cache costs about 80
    CPU-s, so the test runs where one is given: .ci/run's kernel lane snapshots the cache its
    warm-up wrote (``AIAYN_WARMED_NUMBA_CACHE``)."""
    warmed = os.environ.get(WARMED)
    if not warmed:
        pytest.skip(f"needs {WARMED}, a numba cache that warm_up() alone filled (.ci/run's "
                    "kernel lane)")
    shutil.copytree(warmed, tmp_path / "cache")
    code = """
import json, sys
from numba.core.dispatcher import Dispatcher
import test_kernel_engine as t
from test_search import tiny_model
m = tiny_model(60, seed=3)
t.greedy(m)
t.greedy(t.int8_model())
found = {id(f): (n, f) for name, mod in list(sys.modules.items())
         if name.startswith("aiayn.model.kernels") for n, f in vars(mod).items()
         if isinstance(f, Dispatcher)}
print(json.dumps({"dispatchers": len(found), "missed": sorted(
    n for n, f in found.values() if sum(f.stats.cache_misses.values()))}))
"""
    result = run(code, {"NUMBA_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    got = json.loads(result.stdout)
    assert got["dispatchers"] > 10, got  # the kernel package's dispatchers were found
    assert got["missed"] == [], f"compiled at first use after warm_up(): {got['missed']}"


@pytest.mark.slow
def test_the_avx2_variant_runs_a_whole_int8_decode_on_any_avx2_machine():
    """AIAYN_FORCE_ISA=avx2 on a VNNI machine: the AVX2 class's 7-bit weight grid and its
    u8s8 variant, through a whole greedy decode: the same outputs as ``torch._int_mm`` over
    the same weights, bit for bit."""
    if "avx2" not in kernels.u8s8_variants():
        pytest.skip("numba's target has no AVX2")
    code = """
import os
import test_kernel_engine as t
from aiayn.model import kernels, quantize
assert quantize.weight_levels() == 63 and quantize.u8s8_variant() == "avx2"
out = []
for path in ("u8s8", "int_mm"):
    os.environ["AIAYN_INT8_PRODUCT"] = path
    q = t.int8_model()
    assert max(int(m.weight_int8.abs().max()) for m in q.modules()
               if isinstance(m, quantize.Int8Linear)) == 63
    out.append(t.greedy(q))
assert out[0] == out[1], out
print(kernels.build_record()["isa"])
"""
    result = run(code, {"AIAYN_FORCE_ISA": "avx2"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["avx2"]


@pytest.mark.slow
def test_a_forced_variant_the_cpu_lacks_is_refused_in_one_line():
    """AIAYN_FORCE_ISA=vnni where numba's target has only AVX2: a one-line ConfigError when
    the int8 copy is made, before anything is compiled (LLVM would abort the process on a VNNI
    instruction for that target)."""
    code = """
import test_kernel_engine as t
from aiayn.errors import ConfigError
try:
    t.int8_model()
except ConfigError as error:
    print(error)
    raise SystemExit(2)
"""
    result = run(code, {"AIAYN_FORCE_ISA": "vnni", "NUMBA_CPU_NAME": "haswell",
                        "NUMBA_CPU_FEATURES": "+avx2,+fma"})
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stdout.startswith("AIAYN_FORCE_ISA=vnni: numba's target CPU lacks")
    assert result.stdout.count("\n") == 1 and "LLVM ERROR" not in result.stderr


def test_bad_values_of_the_variables_are_refused_in_one_line(monkeypatch):
    from aiayn.model import quantize
    from aiayn.model.kernels import cpu

    monkeypatch.setenv("AIAYN_INT8_PRODUCT", "mkl")
    with pytest.raises(ConfigError, match=r"^AIAYN_INT8_PRODUCT=mkl: .*int_mm") as found:
        quantize.forced_product()
    assert "\n" not in str(found.value)
    monkeypatch.setenv("AIAYN_FORCE_ISA", "sse2")
    with pytest.raises(ConfigError, match=r"^AIAYN_FORCE_ISA=sse2: .*avx2, vnni"):
        cpu.forced_isa()


# numba targets and the LLVM features that make them, with the variants each should list
TARGETS = {
    "haswell": ("+avx2,+fma", ("avx2",)),
    "skylake-avx512": ("+avx2,+fma,+avx512f,+avx512bw,+avx512dq,+avx512vl,+avx512cd",
                       ("avx2",)),
    "icelake-server": ("+avx2,+fma,+avx512f,+avx512bw,+avx512dq,+avx512vl,+avx512cd,"
                       "+avx512vnni", ("vnni", "avx2")),
}


@pytest.mark.slow
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_each_variant_compiles_for_each_target_and_sums_exactly_where_it_runs(target,
                                                                               tmp_path):
    """Each u8s8 variant compiled for numba targets this CPU may not be (a fresh cache, so it
    really compiles): the variants the target has are listed, and where this CPU can run the
    target's code, the product's int32 sums equal torch's at full range (else it is only
    compiled), and attention compiled for the target gives eq. 1 within float rounding."""
    from llvmlite import binding

    if not binding.get_default_triple().startswith("x86_64"):
        pytest.skip("the u8s8 variants are x86-64's")
    features, variants = TARGETS[target]
    host = binding.get_host_cpu_features()
    runs = all(host.get(f[1:]) for f in features.split(","))
    code = f"""
import numba, torch
from aiayn.model import kernels
from aiayn.model.kernels import int8
found = kernels.u8s8_variants()
assert found == {variants!r}, found
runs = {runs!r}
torch.manual_seed(0)
for variant in found:
    levels = kernels.U8S8_VARIANTS[variant][2]
    w = torch.randint(-levels, levels + 1, (70, 45), dtype=torch.int8)
    x = torch.randint(-127, 128, (9, 45), dtype=torch.int8)
    w[0], w[1], x[0], x[1] = levels, -levels, 127, -127  # int16 pair sums at their largest
    packed, comp, N, _ = kernels.pack_u8s8(w, variant)
    if runs:
        got = kernels.u8s8_product(x, packed, comp, N, variant)
        assert torch.equal(got, x.int() @ w.int().t()), variant
    else:  # compile only: this CPU cannot run the target's instructions
        lanes, vectors, _ = kernels.U8S8_VARIANTS[variant]
        args = (x.numpy(), packed, comp, N, lanes * vectors, int8._U8S8_MARKER[variant])
        int8._u8s8_product.compile(tuple(numba.typeof(a) for a in args))
q, k = torch.randn(6, 1, 2, 16), torch.randn(3, 2, 5, 16)
lengths = torch.tensor([5, 3, 4])
if runs:
    with torch.no_grad():
        got = kernels.attend(q, k, k, lengths, group=2)
    for r in range(6):
        n = int(lengths[r // 2])
        kr = k[r // 2, :, :n].double()
        w = torch.softmax(q[r, 0].double()[:, None] @ kr.transpose(1, 2) / 4.0, dim=-1)
        assert torch.allclose(got[r, 0].double(), (w @ kr)[:, 0], atol=1e-5)
print("ok")
"""
    result = run(code, {"NUMBA_CPU_NAME": target, "NUMBA_CPU_FEATURES": features,
                        "NUMBA_CACHE_DIR": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ok"]


def test_a_family_that_fails_to_compile_falls_back_to_torch_and_says_so(monkeypatch, capsys):
    """A kernel family whose warm-up raises at its first use (as numba's typing or lowering
    errors do) is left out of ENABLED with one line on stderr, and its callers then take
    torch's path; aiayn's u8s8 product failing alike leaves its map to torch's products."""
    from aiayn.model import quantize
    from aiayn.model.kernels import jit

    def broken():
        raise RuntimeError("Failed in nopython mode pipeline\n(details)")

    monkeypatch.setitem(jit.WARM_UPS, "embed", broken)
    monkeypatch.setattr(jit, "_READY", jit._READY - {"embed"})
    monkeypatch.setattr(jit, "ENABLED", set(jit.ENABLED) | {"embed"})
    with torch.no_grad():
        assert not jit.usable(torch.zeros(2), kind="embed")
        assert not jit.usable(torch.zeros(2), kind="embed")  # asked once only
    assert "embed" not in jit.ENABLED
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["aiayn.kernels: the 'embed' kernels failed to compile (RuntimeError: "
                     "Failed in nopython mode pipeline); torch runs them"]
    if quantize.u8s8_variant() is None:
        return
    monkeypatch.setattr(kernels, "u8s8_product", lambda *args: broken())
    w, wt, xs = quantize._probe_operands(64, 48, (4,))
    assert quantize._exact_u8s8(w, wt, xs, quantize.u8s8_variant()) is None
    assert "the u8s8 product" in capsys.readouterr().err


def test_a_map_takes_each_path_of_its_plan_by_row_count_with_the_same_numbers(monkeypatch):
    """One map, three paths by row count (aiayn's u8s8 kernel up to 4 rows, FBGEMM up to 40,
    torch._int_mm above): each product runs where the plan says, and every output is the
    unpacked map's bit for bit, in a copy too."""
    import copy

    from aiayn.model import quantize
    from aiayn.model.quantize import Int8Linear

    if not kernels.u8s8_variants() or "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("needs aiayn's u8s8 kernel and FBGEMM")
    monkeypatch.setattr(quantize, "weight_levels", lambda: 63)  # every variant sums it exactly
    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(96, 80))
    q._set_packing(None)
    xs = {m: torch.randn(m, 96) for m in (1, 4, 17, 40, 130)}
    with torch.inference_mode():
        want = {m: q(x) for m, x in xs.items()}
    ran = []
    for name in ("u8s8_product",):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real: ran.append("u8s8") or real(*a))
    real_fb = quantize._fbgemm_product
    monkeypatch.setattr(quantize, "_fbgemm_product",
                        lambda *a: ran.append("fbgemm") or real_fb(*a))
    q._set_packing(((4, "u8s8"), (40, "fbgemm"), (1 << 62, "int_mm")))
    assert q.packing == "u8s8+fbgemm"
    for model in (q, copy.deepcopy(q)):
        ran.clear()
        with torch.inference_mode():
            for m, x in xs.items():
                assert torch.equal(model(x), want[m]), m
        assert ran == ["u8s8", "u8s8", "fbgemm", "fbgemm"]  # 130 rows: torch._int_mm


def test_a_plan_keeps_each_path_at_the_row_counts_where_it_wins(monkeypatch, request):
    """weight_packing takes, at each probe row count, the fastest path of product_times
    (a packed one only 5% ahead of its rival): the simulated AVX2 class's 512 x 8,003 output
    map, level at 32 rows and 1.7x faster with aiayn's kernel at 128 (docs/benchmarks.md),
    gets the kernel at every row count, FBGEMM on more torch threads at 128 and above and
    torch._int_mm at 32; each product then runs the path its rows and threads say, with the
    unpacked map's numbers. Paths within the margin everywhere give no plan at all."""
    from aiayn.model import quantize
    from aiayn.model.quantize import Int8Linear

    if not kernels.u8s8_variants() or "fbgemm" not in torch.backends.quantized.supported_engines:
        pytest.skip("needs aiayn's u8s8 kernel and FBGEMM")
    monkeypatch.delenv("AIAYN_INT8_PRODUCT", raising=False)
    monkeypatch.setattr(quantize, "weight_levels", lambda: 63)  # every variant sums it exactly
    ms = {"int_mm": (2.2, 11.7, 23.0), "fbgemm": (2.2, 7.2, 14.0)}
    one = {**ms, "u8s8": (1.96, 6.8, 13.0)}
    monkeypatch.setattr(quantize, "product_times", lambda *shape: {"torch": ms, "one_thread": one})
    every = 1 << 62
    plan = quantize.weight_packing(96, 80)
    assert plan == ((32, "u8s8"), (32, "int_mm"), (every, "u8s8"), (every, "fbgemm")), plan
    assert quantize.describe_plan(plan).endswith(
        "up to 32 rows (int_mm on more threads), u8s8 (avx2) above (fbgemm on more threads)"
        if quantize.u8s8_variant() == "avx2" else "(fbgemm on more threads)")

    torch.manual_seed(0)
    q = Int8Linear.from_linear(torch.nn.Linear(96, 80))
    xs = {m: torch.randn(m, 96) for m in (4, 40)}
    q._set_packing(None)
    with torch.inference_mode():
        want = {m: q(x) for m, x in xs.items()}
    q._set_packing(plan)
    ran = []
    real_u8s8, real_fb = kernels.u8s8_product, quantize._fbgemm_product
    monkeypatch.setattr(kernels, "u8s8_product", lambda *a: ran.append("u8s8") or real_u8s8(*a))
    monkeypatch.setattr(quantize, "_fbgemm_product", lambda *a: ran.append("fbgemm") or real_fb(*a))
    request.addfinalizer(lambda n=torch.get_num_threads(): torch.set_num_threads(n))
    for threads, paths in ((1, ["u8s8", "u8s8"]), (2, ["fbgemm"])):  # 4 rows on 2: int_mm
        torch.set_num_threads(threads)
        ran.clear()
        with torch.inference_mode():
            for m, x in xs.items():
                assert torch.equal(q(x), want[m]), (threads, m)
        assert ran == paths, (threads, ran)

    level = {"int_mm": (1.0, 4.0, 8.0), "fbgemm": (0.97, 3.9, 7.8)}
    monkeypatch.setattr(quantize, "product_times", lambda *shape: {
        "torch": level, "one_thread": {**level, "u8s8": (0.96, 3.85, 7.7)}})
    assert quantize.weight_packing(96, 80) is None


def test_the_wrappers_refuse_mismatched_shapes_before_compiled_code_runs():
    """u8s8_product and attend check what compiled code would read out of bounds."""
    if not kernels.u8s8_variants():
        pytest.skip("the u8s8 product needs x86-64 with AVX2")
    variant = kernels.u8s8_variants()[-1]
    w8 = torch.randint(-63, 64, (40, 32), dtype=torch.int8)
    packed, comp, N, _ = kernels.pack_u8s8(w8, variant)
    x8 = torch.zeros(3, 33, dtype=torch.int8)  # one input more than the weight's
    with pytest.raises(ValueError, match="x8 has 33 inputs"):
        kernels.u8s8_product(x8, packed, comp, N, variant)
    with pytest.raises(ValueError, match="N is 900"):
        kernels.u8s8_product(x8[:, :32], packed, comp, 900, variant)
    with pytest.raises(ValueError, match="x8 must be int8"):
        kernels.u8s8_product(x8[:, :32].float(), packed, comp, N, variant)
    with pytest.raises(ValueError, match="pack_u8s8: an int8"):
        kernels.pack_u8s8(w8.float(), variant)
    q, k = torch.zeros(4, 1, 2, 8), torch.zeros(2, 2, 5, 8)
    with pytest.raises(ValueError, match="attend: "):
        kernels.attend(q, k, k[:, :, :3], torch.tensor([5, 5]), group=2)  # fewer values
    with pytest.raises(ValueError, match="attend: "):
        kernels.attend(q, k, k, torch.tensor([5, 5]), group=3)


def test_translate_warns_in_one_line_where_the_machine_differs_from_the_runs(tmp_path):
    """A run's generation record keeps build_record(); loading it on a machine whose record
    differs where the tokens can change (numba here) says so once; the same machine, never."""
    sys.path.insert(0, str(UNIT.parent))
    from serving import tiny_checkpoint

    from aiayn import Translator
    from aiayn.config import DecodeConfig
    from aiayn.rundir import write_generation_config

    run = tmp_path / "run"
    member = tiny_checkpoint(run / "member-1" / "averaged")
    here = kernels.build_record()
    said: list[str] = []
    for machine in (here, {**here, "numba": "0.0.1"}):
        write_generation_config(run, [member], DecodeConfig(), precision="fp32",
                                machine=machine)
        Translator.from_pretrained(run, device="cpu", warn=said.append)
    assert len(said) == 1 and f"numba {here['numba']} here, 0.0.1 in the run" in said[0]
