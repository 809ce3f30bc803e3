"""``python -m coldsnap.workloads.torch_lm``: one rank in this process, or a supervisor of ``--tp`` ranks."""

from __future__ import annotations

import argparse
import sys

from coldsnap.workloads.torch_lm import __doc__ as _doc

SIZE_NAMES = ("1b", "8b", "tiny")  # coldsnap.workloads.torch_lm.model.SIZES, without importing torch


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m coldsnap.workloads.torch_lm", description=_doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=SIZE_NAMES, default="tiny")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu; with --tp, rank r uses cuda:r)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-seq", type=int, default=None, help="KV cache length (default: the shape's maximum)")
    parser.add_argument("--tp", type=int, default=1, metavar="N", help="tensor-parallel ranks, one process each (default 1)")
    parser.add_argument("--nnodes", type=int, default=1, metavar="N", help="hosts the --tp ranks are spread over, "
                        "--tp/N on each (default 1); every host runs this command with its own --node-rank")
    parser.add_argument("--node-rank", type=int, default=0, metavar="K", help="this host's index, 0..N-1 (node 0 runs "
                        "rank 0, which serves HTTP)")
    parser.add_argument("--master-addr", metavar="ADDR", help="--nnodes > 1: node 0's address, where the other nodes' "
                        "ranks first meet rank 0")
    parser.add_argument("--master-port", type=int, default=29500, metavar="P", help="--nnodes > 1: that meeting "
                        "port (default 29500)")
    parser.add_argument("--write-safetensors", metavar="DIR", help="write the weights as safetensors and exit")
    parser.add_argument("--weights", metavar="DIR", help="load the weights from DIR/model.safetensors (written by "
                        "--write-safetensors on the same kind of device) instead of drawing them from the seed; they "
                        "are then the recovery source a capture pins")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="decode eagerly on the GPU too")
    # Set by the supervisor for each rank process.
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--channels", default="", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tp < 1:
        parser.error("--tp must be at least 1")
    if args.tp > 1 and (args.write_safetensors or args.weights):
        parser.error("--write-safetensors and --weights are for the unsplit model: leave out --tp")
    if args.nnodes > 1:
        if args.tp % args.nnodes:
            parser.error(f"--tp {args.tp} does not split over --nnodes {args.nnodes}")
        if not 0 <= args.node_rank < args.nnodes:
            parser.error(f"--node-rank must be in 0..{args.nnodes - 1}")
        if args.master_addr is None:
            parser.error("--nnodes > 1 needs --master-addr (node 0's address)")
    local = args.tp // args.nnodes  # ranks on this host: node K runs K*local .. K*local+local-1
    if args.rank is None and local == 1 and args.nnodes > 1:  # one rank here: no supervisor
        args.rank = args.node_rank
    if args.tp > 1 and args.rank is None:
        from coldsnap.workloads.torch_lm.ranks import supervise

        return supervise(sys.argv[1:] if argv is None else list(argv), args.tp, first=args.node_rank * local,
                         local=local, channels=args.nnodes == 1)
    from coldsnap.workloads.torch_lm.serve import serve

    return serve(args, parser)


if __name__ == "__main__":
    sys.exit(main())
