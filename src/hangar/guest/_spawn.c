/* hangar.guest._spawn: start a program straight into a cgroup (Linux x86-64, clone3).
 *
 * The guest agent's native way to start a command (hangar.guest.spawn says when it is
 * used and what it replaces). One function, ``spawn``; see its docstring (SPAWN_DOC).
 *
 * How: ``clone3`` with CLONE_VM | CLONE_VFORK (the child borrows the agent's memory, as
 * glibc's posix_spawn does, so no page table is copied), CLONE_PIDFD (the child's pidfd
 * comes with it) and CLONE_INTO_CGROUP (Linux 5.7+: the child starts in the command's
 * cgroup, so the agent never moves itself into that group and back, which took the
 * kernel's cgroup lock twice per command). The child runs on a stack of its own
 * (``child_stack``), with every signal blocked, until its ``execve``:
 *   1. a session of its own (setsid), stdin/stdout/stderr from the given fds;
 *   2. the working directory (chdir);
 *   3. the user's groups, gid and uid (raw system calls: glibc's wrappers would signal
 *      the agent's threads), its ambient capabilities cleared first;
 *   4. every signal at its default action (a handler of the agent's must never run on
 *      the borrowed memory, an ignored signal must not outlive the exec) and none
 *      blocked;
 *   5. ``execve`` of each candidate path in turn, as ``execvpe``: a path that does not
 *      exist (ENOENT, ENOTDIR) is skipped; the error is that of the first one that
 *      exists but failed, else ENOENT.
 * A failing step writes its errno and step to memory the parent shares and exits 127;
 * the parent reaps the child and raises OSError. Standard C and the Python limited API
 * (3.11): one build serves every CPython from 3.11 on (hangar.images.initramfs builds
 * it with the host's C compiler into the initramfs).
 */
#define Py_LIMITED_API 0x030b0000
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/sched.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#if !defined(__x86_64__)
#error "hangar.guest._spawn is written for x86-64 (its clone3 entry is assembly)"
#endif

#define STACK_SIZE (64 * 1024)
#define MAX_GROUPS 65536

enum step { STEP_NONE = 0, STEP_FDS, STEP_CWD, STEP_IDS, STEP_EXEC };

struct plan {
    char *const *paths;     /* candidate program paths, NULL-terminated */
    char *const *argv;
    char *const *envp;
    int fds[3];             /* stdin, stdout, stderr */
    const char *cwd;        /* NULL: the agent's own */
    long uid, gid;          /* -1: keep root's */
    gid_t *groups;
    long ngroups;
    /* written by the child */
    volatile int err;
    volatile int step;
};

static char *child_stack;

static void fail(struct plan *p, int step, int err) {
    p->step = step;
    p->err = err ? err : EINVAL;
    syscall(SYS_exit, 127);
}

static int child_main(void *arg) {
    struct plan *p = arg;
    long n;
    syscall(SYS_setsid);
    for (int i = 0; i < 3; i++) {
        int fd = p->fds[i];
        if (fd == i) {
            if (syscall(SYS_fcntl, fd, F_SETFD, 0) < 0) fail(p, STEP_FDS, errno);
        } else if (syscall(SYS_dup2, fd, i) < 0) {
            fail(p, STEP_FDS, errno);
        }
    }
    if (p->cwd != NULL && syscall(SYS_chdir, p->cwd) < 0) fail(p, STEP_CWD, errno);
    if (p->uid >= 0) {
        syscall(SYS_prctl, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
        if (syscall(SYS_setgroups, p->ngroups, p->groups) < 0
            || syscall(SYS_setresgid, p->gid, p->gid, p->gid) < 0
            || syscall(SYS_setresuid, p->uid, p->uid, p->uid) < 0)
            fail(p, STEP_IDS, errno);
    }
    /* every signal to its default action (the kernel's own sigaction ABI: handler, flags,
       restorer, mask), then none blocked */
    struct { void *handler; unsigned long flags; void *restorer; unsigned long mask; } sa, old;
    memset(&sa, 0, sizeof sa);
    for (int sig = 1; sig < 65; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP) continue;
        if (syscall(SYS_rt_sigaction, sig, NULL, &old, 8) == 0 && old.handler != NULL)
            syscall(SYS_rt_sigaction, sig, &sa, NULL, 8);
    }
    unsigned long none = 0;
    syscall(SYS_rt_sigprocmask, SIG_SETMASK, &none, NULL, 8);
    int first = 0;
    for (char *const *path = p->paths; *path != NULL; path++) {
        syscall(SYS_execve, *path, p->argv, p->envp);
        n = errno;
        if (n != ENOENT && n != ENOTDIR && first == 0) first = (int)n;
    }
    fail(p, STEP_EXEC, first ? first : ENOENT);
    return 127;
}

/* clone3 with the child on child_stack running child_main(arg); the parent gets the pid
   (or -errno). The child's first instructions run on its new stack, so the call is in
   assembly, as in C libraries' own clone. */
static long clone3_call(struct clone_args *ca, int (*fn)(void *), void *arg) {
    long ret;
    register void *r12 __asm__("r12") = (void *)fn;
    register void *r13 __asm__("r13") = arg;
    __asm__ volatile(
        "syscall\n\t"
        "test %%rax, %%rax\n\t"
        "jnz 1f\n\t"
        "xor %%ebp, %%ebp\n\t"
        "mov %%r13, %%rdi\n\t"
        "call *%%r12\n\t"
        "mov %%eax, %%edi\n\t"
        "mov $60, %%eax\n\t"
        "syscall\n\t"
        "1:\n\t"
        : "=a"(ret)
        : "a"((long)SYS_clone3), "D"(ca), "S"(sizeof(*ca)), "r"(r12), "r"(r13)
        : "rcx", "r11", "memory");
    return ret;
}

/* ``o`` (str, encoded as the file system does, or bytes) as a C string kept alive in
   ``keep``; NULL with ValueError when it holds a NUL byte (``what`` names it). */
static char *kept_string(PyObject *o, const char *what, PyObject *keep) {
    PyObject *b = PyUnicode_Check(o) ? PyUnicode_EncodeFSDefault(o) : (Py_INCREF(o), o);
    if (b == NULL) return NULL;
    int bad = PyList_Append(keep, b) < 0;
    Py_DECREF(b);
    char *s = bad ? NULL : PyBytes_AsString(b);
    if (s != NULL && (Py_ssize_t)strlen(s) != PyBytes_Size(b)) {
        PyErr_Format(PyExc_ValueError, "embedded null byte in %s", what);
        return NULL;
    }
    return s;
}

/* A NULL-terminated array of ``seq``'s strings (``kept_string``). */
static char **string_array(PyObject *seq, const char *what, PyObject *keep) {
    Py_ssize_t n = PySequence_Size(seq);
    if (n < 0) return NULL;
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) { PyErr_NoMemory(); return NULL; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_GetItem(seq, i);
        out[i] = item == NULL ? NULL : kept_string(item, what, keep);
        Py_XDECREF(item);
        if (out[i] == NULL) { PyMem_Free(out); return NULL; }
    }
    return out;
}

/* "KEY=VALUE" strings of a str → str dict, NULL-terminated (``kept_string``). */
static char **env_array(PyObject *env, PyObject *keep) {
    Py_ssize_t n = PyDict_Size(env);
    if (n < 0) return NULL;
    char **out = PyMem_Calloc((size_t)n + 1, sizeof(char *));
    if (out == NULL) { PyErr_NoMemory(); return NULL; }
    Py_ssize_t pos = 0, i = 0;
    PyObject *k, *v;
    while (PyDict_Next(env, &pos, &k, &v)) {
        PyObject *pair = PyUnicode_FromFormat("%U=%U", k, v);
        out[i] = pair == NULL ? NULL : kept_string(pair, "env", keep);
        Py_XDECREF(pair);
        if (out[i++] == NULL) { PyMem_Free(out); return NULL; }
    }
    return out;
}

/* Raise the OSError (its errno subclass) of ``err``, naming ``filename`` when not NULL. */
static PyObject *raise_errno(int err, PyObject *filename) {
    errno = err;
    return PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, filename);
}

PyDoc_STRVAR(SPAWN_DOC,
"spawn(paths, argv, env, fds, cwd, cgroup, uid, gid, groups) -> (pid, pidfd)\n\n"
"Start a program; see hangar.guest._spawn.c's header for the steps.\n"
"paths: candidate program paths (str or bytes), tried in order; argv: str or bytes;\n"
"env: dict of str; fds: (stdin, stdout, stderr) fds the child takes as 0, 1, 2;\n"
"cwd: str or None (stay); cgroup: an open cgroup directory fd, or -1 (the agent's);\n"
"uid, gid: -1 to stay root, else the user's, with groups (a sequence of int).\n"
"Returns the child's pid and a pidfd of it (close-on-exec). Raises OSError: a\n"
"failed chdir with filename=cwd, a failed execve with filename=paths[0], clone3's\n"
"own error (ENOSYS where the kernel has none) with no filename.");

static PyObject *spawn(PyObject *self, PyObject *args) {
    PyObject *paths_o, *argv_o, *env_o, *fds_o, *cwd_o, *groups_o;
    int cgroup;
    long uid, gid;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO!OOillO", &paths_o, &argv_o, &PyDict_Type, &env_o,
                          &fds_o, &cwd_o, &cgroup, &uid, &gid, &groups_o))
        return NULL;
    struct plan p;
    memset(&p, 0, sizeof p);
    PyObject *keep = PyList_New(0);
    char **paths = NULL, **argv = NULL, **envp = NULL;
    gid_t *groups = NULL;
    PyObject *result = NULL;
    if (keep == NULL) return NULL;
    if ((paths = string_array(paths_o, "a path", keep)) == NULL) goto done;
    if ((argv = string_array(argv_o, "argv", keep)) == NULL) goto done;
    if ((envp = env_array(env_o, keep)) == NULL) goto done;
    if (paths[0] == NULL || argv[0] == NULL) {
        PyErr_SetString(PyExc_ValueError, "paths and argv must not be empty");
        goto done;
    }
    if (!PyArg_ParseTuple(fds_o, "iii", &p.fds[0], &p.fds[1], &p.fds[2])) goto done;
    if (cwd_o != Py_None && (p.cwd = kept_string(cwd_o, "cwd", keep)) == NULL) goto done;
    p.uid = uid;
    p.gid = gid;
    if (uid >= 0) {
        Py_ssize_t n = PySequence_Size(groups_o);
        if (n < 0) goto done;
        if (n > MAX_GROUPS) { PyErr_SetString(PyExc_ValueError, "too many groups"); goto done; }
        groups = PyMem_Calloc((size_t)n + 1, sizeof(gid_t));
        if (groups == NULL) { PyErr_NoMemory(); goto done; }
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *g = PySequence_GetItem(groups_o, i);
            if (g == NULL) goto done;
            long v = PyLong_AsLong(g);
            Py_DECREF(g);
            if (v == -1 && PyErr_Occurred()) goto done;
            groups[i] = (gid_t)v;
        }
        p.groups = groups;
        p.ngroups = (long)n;
    }
    p.paths = paths;
    p.argv = argv;
    p.envp = envp;
    if (child_stack == NULL) {
        void *s = mmap(NULL, STACK_SIZE, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
        if (s == MAP_FAILED) { raise_errno(errno, NULL); goto done; }
        child_stack = s;
    }

    struct clone_args ca;
    int pidfd = -1;
    memset(&ca, 0, sizeof ca);
    ca.flags = CLONE_VM | CLONE_VFORK | CLONE_PIDFD | (cgroup >= 0 ? CLONE_INTO_CGROUP : 0);
    ca.pidfd = (uint64_t)(uintptr_t)&pidfd;
    ca.exit_signal = SIGCHLD;
    ca.stack = (uint64_t)(uintptr_t)child_stack;
    ca.stack_size = STACK_SIZE;
    ca.cgroup = cgroup >= 0 ? (uint64_t)cgroup : 0;
    /* the GIL stays held: no other thread of the agent spawns meanwhile (one child stack) */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    long pid = clone3_call(&ca, child_main, &p);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) { raise_errno((int)-pid, NULL); goto done; }
    if (p.step != STEP_NONE) {
        int status;
        while (waitpid((pid_t)pid, &status, 0) < 0 && errno == EINTR) {}
        close(pidfd);
        PyObject *name = NULL;
        if (p.step == STEP_CWD) name = cwd_o;
        else if (p.step == STEP_EXEC) name = PySequence_GetItem(paths_o, 0);
        raise_errno(p.err, name);
        if (p.step == STEP_EXEC) Py_XDECREF(name);
        goto done;
    }
    result = Py_BuildValue("(li)", pid, pidfd);
done:
    PyMem_Free(paths);
    PyMem_Free(argv);
    PyMem_Free(envp);
    PyMem_Free(groups);
    Py_DECREF(keep);
    return result;
}

static PyMethodDef methods[] = {
    {"spawn", spawn, METH_VARARGS, SPAWN_DOC},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_spawn",
    "Start a program straight into a cgroup with clone3 (see hangar.guest.spawn).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__spawn(void) { return PyModule_Create(&module); }
