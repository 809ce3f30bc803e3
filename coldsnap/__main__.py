"""The ``coldsnap`` program (``python -m coldsnap`` and the console script).

``coldsnap wake`` first asks the standby to start filling its weights (:mod:`coldsnap.activation.early_wake`,
standard library only), so that the fill runs while this process imports the rest of coldsnap; then
everything is the CLI's (:func:`coldsnap.cli.run`)."""

import sys


def main() -> None:
    if sys.argv[1:2] == ["wake"]:
        from coldsnap.activation.early_wake import start_prefill

        start_prefill(sys.argv[2:])
    from coldsnap.cli import run

    run()


if __name__ == "__main__":
    main()
