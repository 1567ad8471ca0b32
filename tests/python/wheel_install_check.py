"""pip packaging, end to end: builds the wheel from the source tree with the torch of this
interpreter (`pip wheel --no-build-isolation`), installs it into a brand-new virtual environment
and runs a two-rank Gloo gather from there, in a directory outside the tree, with no PYTHONPATH.

The new environment reuses this interpreter's torch through a .pth file (torch with its CUDA
libraries is 5 GB: installing it again would test PyPI, not us), so the wheel is installed with
--no-deps --no-index (nothing is downloaded) and the gather script checks that the installed
package's own `torch` requirement is met by the torch it runs with.

    .venv/bin/python tests/python/wheel_install_check.py [SOURCE_DIR [--config-settings=KEY=VALUE ...]]

The settings go to `pip wheel` (scikit-build-core's: the ctest that runs this passes its own
build's type and flags, so that a compiler cache can serve the objects).
"""

import glob
import os
import subprocess
import sys
import sysconfig
import tempfile

import torch

GATHER = r'''
import os, sys, tempfile
import torch, torch.distributed as dist, torch.multiprocessing as mp
import shardgather

def rank_main(rank, world, init_file):
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    params = [torch.arange(rank + 3, dtype=torch.float32) + 10 * rank, torch.full((2, 2), rank)]
    out = shardgather.foreach_all_gather(params, timeout=60)
    for r in range(world):
        assert torch.equal(out[0][r], torch.arange(r + 3, dtype=torch.float32) + 10 * r)
        assert torch.equal(out[1][r], torch.full((2, 2), r))
    dist.barrier()
    dist.destroy_process_group()

if __name__ == "__main__":
    venv = sys.argv[1]
    where = os.path.realpath(shardgather.__file__)
    assert where.startswith(os.path.realpath(venv)), where
    from importlib import metadata
    from packaging.requirements import Requirement
    (want,) = [Requirement(r) for r in metadata.requires("shardgather") if r.startswith("torch")]
    assert want.specifier.contains(torch.__version__.split("+")[0]), (str(want), torch.__version__)
    fd, init_file = tempfile.mkstemp(); os.close(fd); os.unlink(init_file)
    mp.spawn(rank_main, args=(2, init_file), nprocs=2, join=True)
    print("two-rank gather from", where, "ok")
'''


def run(cmd, **kw):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main():
    source = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else
                             os.path.join(os.path.dirname(__file__), "..", ".."))
    with tempfile.TemporaryDirectory(prefix="sg-wheel-") as tmp:
        dist_dir = os.path.join(tmp, "dist")
        run([sys.executable, "-m", "pip", "wheel", source, "--no-build-isolation", "--no-deps",
             "-q", "-w", dist_dir, *sys.argv[2:]])
        wheels = glob.glob(os.path.join(dist_dir, "shardgather-*.whl"))
        assert len(wheels) == 1, wheels
        venv = os.path.join(tmp, "venv")
        run([sys.executable, "-m", "venv", venv])
        python = os.path.join(venv, "bin", "python")
        site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True).stdout.strip()
        torch_site = os.path.dirname(os.path.dirname(torch.__file__))
        with open(os.path.join(site, "torch-from-build-env.pth"), "w") as f:
            f.write(torch_site + "\n")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", wheels[0]], env=env)
        script = os.path.join(tmp, "gather.py")
        with open(script, "w") as f:
            f.write(GATHER)
        run([python, script, venv], env=env, cwd=tmp)
        # Built for another torch: a clear ImportError before the extension loads.
        info = os.path.join(site, "shardgather", "_build_info.py")
        with open(info, "w") as f:
            f.write('TORCH_VERSION = "0.0.1"\n')
        r = subprocess.run([python, "-c", "import shardgather"], env=env, cwd=tmp,
                           capture_output=True, text=True)
        assert r.returncode != 0 and "ImportError" in r.stderr, r.stderr
        assert "built against torch 0.0.1" in r.stderr, r.stderr
        print("a wheel for another torch: ImportError, as it should")


if __name__ == "__main__":
    main()
