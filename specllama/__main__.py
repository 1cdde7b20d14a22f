import sys

try:  # a Ctrl-C while the CLI's modules import is an interrupt too, not a traceback
    from .cli import main
except KeyboardInterrupt:
    sys.stderr.write("\ninterrupted\n")
    sys.exit(130)

main(prog_name="specllama")
