from .errors import exit_interrupted

try:  # a Ctrl-C while the CLI's modules import is an interrupt too, not a traceback
    from .cli import main
except KeyboardInterrupt:
    exit_interrupted()

main(prog_name="specllama")
