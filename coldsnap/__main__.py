from coldsnap.cli import run

run()
