"""The program's prelude: run as ``python -I -B -c <this file's source> START_FD``, as the sandbox
user under the rlimits.

It makes ``__main__`` what ``python -I -B main.py`` would have made it (``__file__``,
``__loader__``, ``sys.argv``, ``sys.path[0]``, tracebacks without this frame), writes the
CLOCK_MONOTONIC time on the start fd and closes it, and only then compiles and runs main.py in
``__main__``.  The program's wall clock (``timeout_s``) starts at that time, so the
interpreter's own start-up is the sandbox's and compiling the program is the program's.  What
is left of it: the program runs two frames deeper (a RecursionError comes two calls sooner), and
an excepthook the program installs itself sees this frame.
"""


def _megarl_prelude():
    import os
    import sys
    import time
    from importlib.machinery import SourceFileLoader

    fd = int(sys.argv[1])
    main = sys.modules["__main__"].__dict__
    del main["_megarl_prelude"]
    path = os.path.join(os.getcwd(), "main.py")
    with open(path, "rb") as f:
        src = f.read()
    main.update(__file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path),
                __doc__=None)
    sys.argv[:] = ["main.py"]
    if sys.path[:1] == [""]:  # Python < 3.11 (no safe_path): a script's directory comes first, not ""
        sys.path[0] = os.getcwd()
    top = sys._getframe(1).f_code

    def excepthook(t, v, tb, hook=sys.excepthook):
        if tb is not None and tb.tb_frame.f_code is top:
            tb = tb.tb_next
            if v is not None:
                v.__traceback__ = tb  # the printer reads the exception's traceback, not the argument
        hook(t, v, tb)

    sys.excepthook = excepthook
    os.write(fd, b"%r\n" % time.monotonic())
    os.close(fd)
    return src, path, "exec"


exec(compile(*_megarl_prelude()), globals())
