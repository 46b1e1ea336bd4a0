"""Where Hangar's files live inside a guest: each path named once, for host and guest.

The guest's modules write and read these paths; the host's name them in the
commands it runs there (``hangar.core.desktop``, ``hangar.core.startup``,
``hangar.tools.browser``...) and in the images it builds
(``hangar.images.initramfs``, ``hangar.images.template_builder``). This
module imports nothing, so PID 1 (``hangar.guest.init``) pays nothing for it.

====================  =================================  ==========================================
name                  path                               written by, holds
====================  =================================  ==========================================
``RUN_DIR``           /run/hangar                        the initramfs (a tmpfs ``/run``): the
                                                         guest's run-time state, gone at power-off
``BOOT_MARKS``        /run/hangar/boot                   the initramfs, the guest init: one
                                                         ``<step> <uptime s>`` a line
``FORK_GENERATION``   /run/hangar/fork-generation        ``hangar.guest.identity``: a decimal and
                                                         a newline, replaced by rename
``NET_BATCH``         /run/hangar/net.batch              ``hangar.guest.net``: ``ip -batch`` input
``START_LOG``         /run/hangar/start.log              a template's start command's output
                                                         (``hangar.core.startup``)
``DESKTOP_READY``     /run/hangar/desktop-ready          ``hangar.guest.desktop``: JSON of the
                                                         running X display
``DESKTOP_ERROR``     /run/hangar/desktop-error          ``hangar.guest.desktop``: why it cannot run
``DESKTOP_LOG``       /run/hangar/desktop.log            the desktop supervisor's log (its
                                                         programs' logs are ``<name>.log`` beside)
``KEYMAP_BOUND``      /run/hangar/keymap-bound           ``hangar.guest.desktop``: keycodes bound
                                                         to characters, one a line
``XDG_RUNTIME_DIR``   /run/hangar/xdg                    the desktop's programs' runtime dir
``SCRIPT_DIR``        /run/hangar                        the agent's ``exec``: long shell scripts
                                                         (0600 files, removed after the run)
``TEMPLATE_ENV``      /etc/hangar/env.json               a template's build: a JSON object of
                                                         strings merged into every command's env
``PYTHON_DIR``        /usr/lib/hangar/python             the initramfs: a tmpfs of the guest's
                                                         Python files (``hangar/``), PYTHONPATH
``RUNTIME_DIR``       /usr/lib/hangar/runtime            images that bring Hangar's own Python
                                                         (``hangar.images.runtime``)
``RUNTIME_BIN``       /usr/lib/hangar/runtime/bin        its programs (python3, ip)
``RUNTIME_PYTHON``    /usr/lib/hangar/runtime/bin/python3  its interpreter
``HOME``              /root                              the image: commands' HOME and default
                                                         cwd; relative paths start here
====================  =================================  ==========================================

``CODE_INTERPRETER_SERVER`` (/usr/local/lib/hangar/code_interpreter.py): the
``code-interpreter`` recipe's server on port 49999 (``hangar.images.recipes``).
"""

RUN_DIR = "/run/hangar"
BOOT_MARKS = RUN_DIR + "/boot"
FORK_GENERATION = RUN_DIR + "/fork-generation"
NET_BATCH = RUN_DIR + "/net.batch"
START_LOG = RUN_DIR + "/start.log"
DESKTOP_READY = RUN_DIR + "/desktop-ready"
DESKTOP_ERROR = RUN_DIR + "/desktop-error"
DESKTOP_LOG = RUN_DIR + "/desktop.log"
KEYMAP_BOUND = RUN_DIR + "/keymap-bound"
XDG_RUNTIME_DIR = RUN_DIR + "/xdg"
SCRIPT_DIR = RUN_DIR

TEMPLATE_ENV = "/etc/hangar/env.json"

PYTHON_DIR = "/usr/lib/hangar/python"
RUNTIME_DIR = "/usr/lib/hangar/runtime"
RUNTIME_BIN = RUNTIME_DIR + "/bin"
RUNTIME_PYTHON = RUNTIME_BIN + "/python3"

CODE_INTERPRETER_SERVER = "/usr/local/lib/hangar/code_interpreter.py"
"""The code-interpreter image's server (``hangar/images/files/code_interpreter.py``)."""

HOME = "/root"
