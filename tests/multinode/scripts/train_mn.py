"""A small data-parallel training job for the multi-node tests (plain torch.distributed on gloo).

Reports, on stdout, what the tests check: where it runs, which variables arrived, its argv,
the loss, and whether every rank ends with the same weights. Behaviour is chosen through
variables the test sends with --env (they are not travelling prefixes, so they arrive only
because the launcher sent them): MN_MARKER (a file created at start: proves a rank started),
MN_REPORT (a path prefix: the INFO and ZSTEP lines also go to MN_REPORT.<Open MPI rank, else
RANK> -- a user's own mpirun merges its ranks' output and can join two ranks' lines mid-line),
MN_MODE=train|zero|loop|fail, MN_FAIL_RANK, MN_FAIL_CODE, MN_INIT=zerorun (the process group
from zerorun's own discovery instead of init_process_group's env://), MN_CONFIG.
"""

import hashlib
import os
import socket
import sys
import time

mode = os.environ.get("MN_MODE", "train")
if os.environ.get("MN_MARKER"):
    with open(os.environ["MN_MARKER"] + f".rank{os.environ['RANK']}", "w") as fh:
        fh.write(str(os.getpid()))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

if os.environ.get("MN_INIT") == "zerorun":
    # The process group zerorun.initialize would create, from whatever launcher started us
    # (a user's own mpirun: ranks from OMPI_*/PMIx, rank 0's host from the PMIx server).
    from zerorun.runtime.distributed import init_distributed

    init_distributed()
else:
    dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()


def report(line: str) -> None:
    """Print a line the tests check, and append it to this rank's MN_REPORT file if asked."""
    print(line, flush=True)
    if os.environ.get("MN_REPORT"):
        name = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("RANK"))
        with open(f"{os.environ['MN_REPORT']}.{name}", "a") as fh:
            fh.write(line + "\n")


def digest(name: str) -> str:
    value = os.environ.get(name)
    return "absent" if value is None else hashlib.sha256(value.encode()).hexdigest()[:12]


report(
    f"INFO rank={rank} world={world} local_rank={os.environ.get('LOCAL_RANK')} "
    f"local_world={os.environ.get('LOCAL_WORLD_SIZE')} node_rank={os.environ.get('NODE_RANK')} "
    f"ifname={os.environ.get('GLOO_SOCKET_IFNAME')} nccl_debug={os.environ.get('NCCL_DEBUG')} "
    f"named_secret={digest('MN_API_TOKEN')} unnamed_secret={digest('NCCL_SECRET_TOKEN')} "
    f"host={socket.gethostname()} master={os.environ.get('MASTER_ADDR')}"
)
print("ARGV " + repr(sys.argv[1:]), flush=True)

if mode == "zero":
    # zerorun's own runtime, with the config the launcher validated and sent through
    # ZERORUN_CONFIG_JSON. Every rank trains on the same batches, so every rank must print
    # the same losses: proof that the sharded (ZeRO-3) parameters stay consistent across nodes.
    import zerorun

    print(f"CONFIG_ENV from_config={os.environ.get('MN_FROM_CONFIG')} host_value={os.environ.get('MN_HOST_VALUE')}", flush=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    # MN_CONFIG: a config file for a job no zerorun launcher started (else ZERORUN_CONFIG_JSON).
    engine, _, _, _ = zerorun.initialize(
        model=model, model_parameters=model.parameters(), config=os.environ.get("MN_CONFIG")
    )
    gen = torch.Generator().manual_seed(100)
    true_w = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8
    for step in range(30):
        x = torch.randn(16, 8, generator=gen)
        loss = ((engine(x) - x @ true_w) ** 2).mean()
        engine.backward(loss)
        engine.step()
        if step in (0, 29):
            report(f"ZSTEP {step} loss {loss.item():.6f}")
    dist.barrier()
    dist.destroy_process_group()
    if os.environ.get("MN_INIT") == "zerorun":
        # Run without the shim (a user's own mpirun): skip the interpreter's C++ teardown, in
        # which torch 2.13's gloo aborts now and then ("terminate called without an active
        # exception", SIGABRT), as the shim's own exit does (shim._finish).
        sys.stdout.flush()
        os._exit(0)
    sys.exit(0)

torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
gen = torch.Generator().manual_seed(100 + rank)
true_w = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8
steps = 40 if mode == "train" else 10**9
for step in range(steps):
    x = torch.randn(16, 8, generator=gen)
    loss = ((model(x) - x @ true_w) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    if step == 0 or step == steps - 1 or (mode != "train" and step % 10 == 0):
        print(f"STEP {step} loss {loss.item():.6f}", flush=True)
    if mode == "fail" and rank == int(os.environ.get("MN_FAIL_RANK", "1")) and step == 3:
        print("failing on purpose", file=sys.stderr, flush=True)
        sys.exit(int(os.environ.get("MN_FAIL_CODE", "3")))
    if mode != "train":
        time.sleep(0.05)

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(flat) for _ in range(world)]
dist.all_gather(gathered, flat)
print(f"SAME_WEIGHTS {all(torch.equal(g, flat) for g in gathered)}", flush=True)
# Every rank is done with the collectives before any tears its connections down: without this
# barrier, gloo on torch 2.13 sometimes aborts a rank ("terminate called without an active
# exception") when a peer closes its sockets first (seen about once in 6 runs under load).
dist.barrier()
dist.destroy_process_group()
