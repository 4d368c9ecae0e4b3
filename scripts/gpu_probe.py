"""Facts about a GPU machine that the CPU machine cannot find out, written as JSON lines to the
file named by argv[1]: what CuPy's NCCL says when CUDA runs out of memory inside NCCL, whether a
/dev/shm region can be registered with CUDA (cudaHostRegister) and how fast device-to-host
copies into it are, and the NCCL version."""

from __future__ import annotations

import json
import mmap
import os
import sys
import tempfile
import time
import traceback

import torch

OUT = sys.argv[1] if len(sys.argv) > 1 else "probe.jsonl"


def record(name: str, **fields) -> None:
    with open(OUT, "a") as f:
        f.write(json.dumps({"probe": name, **fields}, default=str) + "\n")
    print(name, fields, flush=True)


def guarded(fn):
    def run():
        try:
            fn()
        except BaseException as e:
            record(fn.__name__, failed=repr(e), trace=traceback.format_exc()[-2000:])
    return run


@guarded
def versions():
    import cupy
    from cupy.cuda import nccl

    record("versions", torch=torch.__version__, cuda=torch.version.cuda, cupy=cupy.__version__,
           nccl=nccl.get_version(), device=torch.cuda.get_device_name(0),
           python=sys.version.split()[0])


def _fill(free_left: int) -> list[torch.Tensor]:
    """Takes the GPU's memory with plain allocations until about `free_left` bytes are free."""
    held = []
    chunk = 1 << 30
    while chunk >= (1 << 20):
        free, _ = torch.cuda.mem_get_info()
        if free - chunk < free_left:
            chunk //= 2
            continue
        try:
            held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError:
            chunk //= 2
    return held


@guarded
def nccl_out_of_memory():
    """A communicator created, then an allreduce, with the GPU's memory nearly all taken."""
    from cupy.cuda import nccl

    torch.cuda.set_device(0)
    x = torch.ones(64 << 20, device="cuda")  # 256 MB, allocated before the memory is taken
    uid = nccl.get_unique_id()
    stream = torch.cuda.Stream()
    for stage in ("init", "allreduce"):
        held = _fill(2 << 20)
        free, total = torch.cuda.mem_get_info()
        try:
            if stage == "init":
                comm = nccl.NcclCommunicator(1, uid, 0)
                record("nccl_oom_init_ok", free=free)
            else:
                comm.allReduce(x.data_ptr(), x.data_ptr(), x.numel(), nccl.NCCL_FLOAT32,
                               nccl.NCCL_SUM, stream.cuda_stream)
                stream.synchronize()
                record("nccl_oom_allreduce_ok", free=free)
        except BaseException as e:
            record(f"nccl_oom_{stage}", type=f"{type(e).__module__}.{type(e).__qualname__}",
                   text=str(e), args=[str(a) for a in getattr(e, "args", ())],
                   status=getattr(e, "status", None), free=free, total=total,
                   torch_free_after=torch.cuda.mem_get_info()[0])
            if stage == "init":
                del held
                torch.cuda.empty_cache()
                comm = nccl.NcclCommunicator(1, uid, 0)
                continue
        del held
        torch.cuda.empty_cache()
    with_error = None
    try:
        comm.abort()
    except BaseException as e:
        with_error = repr(e)
    record("nccl_abort_after", error=with_error)


@guarded
def host_register():
    """A /dev/shm region (as the shared-memory transport maps one) registered with CUDA, and
    the device-to-host copy rates into it, into pinned torch memory and into pageable memory."""
    size = 256 << 20
    fd, path = tempfile.mkstemp(dir="/dev/shm")
    os.ftruncate(fd, size)
    region = mmap.mmap(fd, size)
    os.close(fd)
    os.unlink(path)
    host = torch.frombuffer(region, dtype=torch.uint8)
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(host.data_ptr(), size, 0)
    record("host_register", error=int(err) if not isinstance(err, tuple) else [int(e) for e in err],
           is_pinned=host.is_pinned())
    src = torch.ones(size, dtype=torch.uint8, device="cuda")
    rates = {}
    for name, dst in (("registered_shm", host), ("pinned", torch.empty(size, dtype=torch.uint8,
                                                                          pin_memory=True)),
                      ("pageable", torch.empty(size, dtype=torch.uint8))):
        for _ in range(2):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t
        t = time.perf_counter()
        src.copy_(dst, non_blocking=True)
        torch.cuda.synchronize()
        rates[name] = {"d2h_GBps": size / seconds / 1e9,
                       "h2d_GBps": size / (time.perf_counter() - t) / 1e9}
    record("copy_rates", **rates)
    err = cudart.cudaHostUnregister(host.data_ptr())
    record("host_unregister", error=int(err) if not isinstance(err, tuple) else [int(e) for e in err])


@guarded
def processes_share_the_gpu():
    """Four processes each with a CUDA context on device 0 at once."""
    import subprocess

    code = ("import torch; x = torch.ones(1 << 20, device='cuda'); torch.cuda.synchronize(); "
            "print(float(x.sum()))")
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(4)]
    outs = [p.communicate(timeout=120) for p in procs]
    record("four_processes", codes=[p.returncode for p in procs], out=[o[0].strip() for o in outs],
           err=[o[1][-300:] for o in outs])


if __name__ == "__main__":
    for probe in (versions, host_register, processes_share_the_gpu, nccl_out_of_memory):
        probe()
