"""`vmpool.torch` against a stand-in for PyTorch (the calls `install()`
makes, recorded), in processes of their own, on the host backend: what is
hooked, what PyTorch's statistics and snapshot calls then return, and the
launcher. The real PyTorch runs on the GPU (scripts/torch_wheel_check.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

FAKE_TORCH = {
    "torch/__init__.py": """
        from . import amp, cuda, optim

        class OutOfMemoryError(RuntimeError):
            pass
    """,
    "torch/cuda/__init__.py": """
        from . import _utils, memory

        def is_available():
            return True

        def device_count():
            import os

            return int(os.environ.get("VMPOOL_HOST_DEVICES", "1"))

        def current_device():
            return 0

        capturing = False

        def is_current_stream_capturing():
            return capturing

        _handles = 0

        def graph_pool_handle():
            global _handles
            _handles += 1
            return (0, _handles)

        MemPool = memory.MemPool
        use_mem_pool = memory.use_mem_pool
    """,
    "torch/optim/__init__.py": """
        # As PyTorch's: the submodule loaded, its name not left here.
        from . import optimizer
        del optimizer
    """,
    "torch/optim/optimizer.py": """
        hooks = []

        def register_optimizer_step_post_hook(hook):
            hooks.append(hook)

        def step(optimizer=None):
            # What Optimizer.step() does after its update.
            for hook in hooks:
                hook(optimizer, (), {})
    """,
    "torch/amp/__init__.py": """
        class GradScaler:
            # As PyTorch's: the optimizer's step only if no gradient
            # overflowed (`overflowed`, set by the test).
            overflowed = False

            def step(self, optimizer, *args, **kwargs):
                from torch.optim import optimizer as module

                if not self.overflowed:
                    return module.step(optimizer)
                return None
    """,
    "torch/cuda/_utils.py": """
        def _get_device_index(device, optional=False):
            return 0 if device is None else int(device)
    """,
    "torch/cuda/memory.py": """
        import contextlib
        import ctypes

        current = None

        class _Allocator:
            def __init__(self):
                self.hooks = {}

            def __getattr__(self, name):
                if not name.startswith("set_"):
                    raise AttributeError(name)
                return lambda fn: self.hooks.__setitem__(name, fn)

        class CUDAPluggableAllocator:
            def __init__(self, path, alloc, free):
                self.args = (path, alloc, free)
                self._allocator = _Allocator()

            def allocator(self):
                return self._allocator

        def change_current_allocator(allocator):
            global current
            current = allocator

        class MemPool:
            def __init__(self, *args):
                raise RuntimeError("pluggable does not yet support createOrIncrefPool")

        class _Id(ctypes.Structure):
            _fields_ = [("first", ctypes.c_uint64), ("second", ctypes.c_uint64)]

        def _hook(name, *argtypes):
            fn = current.allocator().hooks[name]
            return ctypes.CFUNCTYPE(None, ctypes.c_int, _Id, *argtypes)(fn)

        @contextlib.contextmanager
        def use_mem_pool(pool, device=None):
            # As PyTorch 2.11 does: begin (with a filter for the thread),
            # then end and release, through the allocator's hooks.
            _hook("set_begin_allocate_to_pool", ctypes.c_void_p)(0, _Id(*pool.id), None)
            try:
                yield
            finally:
                _hook("set_end_allocate_to_pool_fn")(0, _Id(*pool.id))
                _hook("set_release_pool")(0, _Id(*pool.id))
    """,
}


@pytest.fixture()
def fake_torch(tmp_path: Path) -> dict[str, str]:
    for name, text in FAKE_TORCH.items():
        path = tmp_path / "site" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    env = dict(os.environ, VMPOOL_BACKEND="host")
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "site"), *sys.path])
    return env


def _python(env: dict[str, str], *args: str, cwd: Path | None = None) -> str:
    out = subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_install_hooks_pytorch(fake_torch):
    script = """
        import torch
        import vmpool, vmpool.torch

        allocator = vmpool.torch.install()
        assert torch.cuda.memory.current is allocator
        assert allocator.args == (vmpool.library_path(), "vmpool_alloc", "vmpool_free")
        assert sorted(allocator.allocator().hooks) == [
            "set_begin_allocate_to_pool", "set_end_allocate_to_pool_fn", "set_memory_fraction_fn",
            "set_record_stream_fn", "set_release_pool", "set_reset_fn",
        ]
        assert all(isinstance(fn, int) and fn for fn in allocator.allocator().hooks.values())

        p = vmpool.alloc(3 << 20)
        stats = torch.cuda.memory_stats_as_nested_dict()
        assert stats["allocated_bytes"]["all"]["current"] == 3 << 20, stats
        assert torch.cuda.memory_summary().startswith("vmpool on device 0 (host backend)")
        assert vmpool.torch.stats(None).used_bytes == 3 << 20

        torch.cuda.memory._record_memory_history(max_entries=100)
        vmpool.free(p)
        torch.cuda.empty_cache = None  # not hooked here: the C hook is
        vmpool.torch.empty_cache()
        snapshot = torch.cuda.memory._snapshot()
        actions = [e["action"] for e in snapshot["device_traces"][0]]
        assert actions[:2] == ["free_requested", "free_completed"] and "segment_unmap" in actions, actions

        try:
            vmpool.alloc(1 << 40)
            raise AssertionError("no error")
        except torch.OutOfMemoryError:
            pass
        print("ok")
    """
    assert _python(fake_torch, "-c", textwrap.dedent(script)).strip() == "ok"


def test_install_marks_a_step_after_each_optimizer_step(fake_torch):
    script = """
        import torch
        import vmpool, vmpool.torch

        import torch.optim.optimizer as optimizer

        vmpool.torch.install()
        vmpool.torch.install()  # the hook once, however often installed
        assert len(optimizer.hooks) == 1
        p = vmpool.alloc(3 << 20)
        for step in range(1, 4):
            grads = vmpool.alloc(1 << 20)
            optimizer.step()
            vmpool.free(grads)  # zero_grad: still the step ending
            assert vmpool.torch.stats().steps == step - 1
            vmpool.free(vmpool.alloc(1 << 20))  # the next step's first allocation
            assert vmpool.torch.stats().steps == step, vmpool.torch.stats().steps
        # A captured optimizer step replays with no Python: not a step.
        torch.cuda.capturing = True
        optimizer.step()
        torch.cuda.capturing = False
        vmpool.free(vmpool.alloc(1 << 20))
        assert vmpool.torch.stats().steps == 3
        vmpool.free(p)
        # Every device's pool: the second device's marks at its own next allocation.
        q = vmpool.alloc(1 << 20, device=1)
        optimizer.step()
        vmpool.free(vmpool.alloc(1 << 20, device=1))
        assert vmpool.torch.stats(1).steps == 1 and vmpool.torch.stats(0).steps == 3
        vmpool.free(q, device=1)
        print("ok")
    """
    env = dict(fake_torch, VMPOOL_HOST_DEVICES="2")
    assert _python(env, "-c", textwrap.dedent(script)).strip() == "ok"


def test_a_step_the_grad_scaler_skips_ends_its_iteration(fake_torch):
    # Mixed precision: an overflow skips the optimizer's step, and with it
    # the optimizer's hooks. Unmarked, that iteration and the next would
    # make one step, unlike the others, and the layout would be given up.
    script = """
        import torch
        import vmpool, vmpool.torch

        vmpool.torch.install()
        optimizer, scaler = object(), torch.amp.GradScaler()
        weights = vmpool.alloc(8 << 20)
        for iteration in range(10):
            kept, scratch = vmpool.alloc(1 << 20), vmpool.alloc(3 << 20)
            vmpool.free(scratch)
            scaler.overflowed = iteration in (4, 7)
            scaler.step(optimizer)
            vmpool.free(kept)
        stats = vmpool.torch.stats()
        # One mark an iteration, each at the next one's first allocation.
        assert stats.steps == 9, stats.steps
        assert stats.step_layouts == 1 and stats.planned > 0 and stats.missed == 0, stats
        vmpool.free(weights)
        print("ok")
    """
    assert _python(fake_torch, "-c", textwrap.dedent(script)).strip() == "ok"


def test_two_optimizers_mark_one_step_an_iteration(fake_torch):
    # A GAN's loop: the discriminator's half, then the generator's, each
    # with its own optimizer. Marked at both optimizers' steps, the pool's
    # steps would alternate between the halves and never repeat the one
    # before; marked once an iteration, they are laid out.
    script = """
        import torch.optim.optimizer as optimizer
        import vmpool, vmpool.torch

        vmpool.torch.install()
        discriminator, generator = object(), object()
        weights = vmpool.alloc(8 << 20)
        for iteration in range(12):
            kept, scratch = vmpool.alloc(1 << 20), vmpool.alloc(3 << 20)
            vmpool.free(scratch)
            optimizer.step(discriminator)
            vmpool.free(kept)
            kept, scratch = vmpool.alloc(5 << 20), vmpool.alloc(2 << 20)
            vmpool.free(scratch)
            optimizer.step(generator)
            vmpool.free(kept)
        stats = vmpool.torch.stats()
        # Both steps marked until the order repeats (four), then one an
        # iteration; the last mark waits for an allocation.
        assert stats.steps == 4 + (24 - 4) // 2 - 1, stats.steps
        assert stats.step_layouts == 1 and stats.planned > 0 and stats.missed == 0, stats
        vmpool.free(weights)
        print("ok")
    """
    assert _python(fake_torch, "-c", textwrap.dedent(script)).strip() == "ok"


def test_an_older_library_gets_no_marks_and_a_warning(fake_torch):
    # A build from before vmpool_mark_step_at_next_alloc, let in by
    # VMPOOL_ALLOW_MISMATCH: install() works, without the optimizer hook.
    script = """
        import warnings
        import torch.optim.optimizer as optimizer
        import vmpool.torch

        real = vmpool.torch.library()

        class Older:
            def __getattr__(self, name):
                if name == "vmpool_mark_step_at_next_alloc":
                    raise AttributeError(name)
                return getattr(real, name)

        vmpool.torch.library = Older
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            vmpool.torch.install()
        assert len(optimizer.hooks) == 0
        assert [w.category for w in caught] == [RuntimeWarning], caught
        assert "cannot mark steps" in str(caught[0].message)
        print("ok")
    """
    assert _python(fake_torch, "-c", textwrap.dedent(script)).strip() == "ok"


@pytest.mark.parametrize(
    ("setting", "hooks"), [("0", "0"), (" 1 ", "1"), ("yes", "VMPOOL_MARK_STEPS='yes': 1 (mark a step")]
)
def test_vmpool_mark_steps_turns_the_marks_off(fake_torch, setting, hooks):
    script = """
        import torch.optim.optimizer as optimizer
        import vmpool.torch

        try:
            vmpool.torch.install()
            print(len(optimizer.hooks))
        except ValueError as err:
            print(err)
    """
    env = dict(fake_torch, VMPOOL_MARK_STEPS=setting)
    assert _python(env, "-c", textwrap.dedent(script)).startswith(hooks)
    # The argument wins over the setting.
    script = script.replace("install()", "install(mark_steps=False)")
    assert _python(env, "-c", textwrap.dedent(script)).strip() == "0"


def test_the_launcher_runs_a_script_as_python_would(fake_torch, tmp_path):
    (tmp_path / "work").mkdir()
    train = tmp_path / "work" / "train.py"
    train.write_text(
        textwrap.dedent("""
            import sys
            import torch
            assert __name__ == "__main__"
            assert sys.path[0] == __import__("os").path.dirname(__file__), sys.path[0]
            assert torch.cuda.memory.current is not None, "install() ran first"
            print("argv", sys.argv[1:])
        """)
    )
    out = _python(fake_torch, "-m", "vmpool.torch", str(train), "--steps", "3", cwd=tmp_path)
    assert out.strip() == "argv ['--steps', '3']"
    out = _python(fake_torch, "-m", "vmpool.torch", "-m", "train", "x", cwd=tmp_path / "work")
    assert out.strip() == "argv ['x']"


def test_a_mem_pool_takes_the_allocations_of_the_thread_in_it(fake_torch):
    script = """
        import threading
        import torch
        import vmpool, vmpool.torch

        vmpool.torch.install()
        assert torch.cuda.MemPool is vmpool.torch.MemPool
        pool = torch.cuda.MemPool()
        assert pool.id == (0, 1) and pool.device == 0

        # Another thread allocates while this one is in the pool: not from it.
        entered, done, outside = threading.Event(), threading.Event(), []
        def other():
            entered.wait()
            outside.append(vmpool.alloc(2 << 20))
            done.set()
        thread = threading.Thread(target=other)
        thread.start()
        with torch.cuda.use_mem_pool(pool):
            entered.set()
            inside = [vmpool.alloc(4 << 20), vmpool.alloc(1 << 20)]
            done.wait()
        thread.join()
        assert pool.stats().used_bytes == 5 << 20
        s = vmpool.torch.stats()
        assert (s.used_bytes, s.mem_pool_used_bytes, s.mem_pools) == (2 << 20, 5 << 20, 1), s
        after = vmpool.alloc(1 << 20)
        assert vmpool.torch.stats().used_bytes == 3 << 20, "outside use_mem_pool: the device's pool"

        try:
            pool.release()
            raise AssertionError("released with tensors live")
        except vmpool.VmpoolError:
            pass
        for p in inside + outside + [after]:
            vmpool.free(p)
        assert vmpool.torch.stats().mem_pool_reserved_bytes >= 5 << 20
        pool.release()
        s = vmpool.torch.stats()
        assert (s.mem_pools, s.mem_pool_reserved_bytes) == (0, 0), s

        # Dropped with a tensor live: the pool goes with it.
        second = torch.cuda.MemPool()
        with torch.cuda.use_mem_pool(second):
            kept = vmpool.alloc(1 << 20)
        del second
        assert vmpool.torch.stats().mem_pools == 1
        vmpool.free(kept)
        assert vmpool.torch.stats().mem_pools == 0
        print("ok")
    """
    assert _python(fake_torch, "-c", textwrap.dedent(script)).strip() == "ok"
