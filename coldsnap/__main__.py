"""The ``coldsnap`` program (``python -m coldsnap`` and the console script).

``coldsnap wake`` first asks the standby to start filling its weights (:mod:`coldsnap.activation.early_wake`),
and ``coldsnap restore`` first starts CRIU's restore of the tree (:mod:`coldsnap.activation.early_restore`),
both with the standard library only, so that the work runs while this process imports the rest of coldsnap;
then everything is the CLI's (:func:`coldsnap.cli.run`)."""

import sys
import time


def main() -> None:
    entry = None  # restore: what the entry did (a tree started, or why not), handed to the restore
    if sys.argv[1:2] == ["wake"]:
        from coldsnap.activation.early_wake import start_prefill

        start_prefill(sys.argv[2:])
    elif sys.argv[1:2] == ["restore"]:
        origin = (time.monotonic_ns(), time.time_ns())  # (the operation's clock starts here, not after the import)
        from coldsnap.activation.early_restore import start_tree

        entry = start_tree(sys.argv[2:], origin)
    try:
        from coldsnap.cli import run
    except BaseException:  # (^C during the imports: the tree the entry started goes with this process)
        if entry is not None:
            entry.abandon()
        raise
    run(entry)


if __name__ == "__main__":
    main()
