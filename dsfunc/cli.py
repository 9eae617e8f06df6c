"""The ``dsfunc`` command: ``dsfunc export ...``, or the launcher ``dsfunc [flags] script.py [args]``."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``dsfunc`` console script; exits with the job's exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:
        from dsfunc.checkpoint.export import main as export_main

        sys.exit(export_main(argv[1:]))
    from dsfunc.launcher.commands import LauncherError
    from dsfunc.launcher.environment import EnvFileError
    from dsfunc.launcher.flags import parse_launcher_args
    from dsfunc.launcher.resources import ResourceError
    from dsfunc.launcher.run import launch

    args = parse_launcher_args(argv)
    try:
        code = launch(args)
    except (LauncherError, ResourceError, EnvFileError) as e:
        print(f"dsfunc: error: {e}", file=sys.stderr)
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
