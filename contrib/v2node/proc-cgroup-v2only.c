/*
 * proc-cgroup-v2only.so: an LD_PRELOAD library that lets Slurm's cgroup/v2
 * plugin run for real on a hybrid-cgroup host (cgroup v1 controllers beside
 * a cgroup2 hierarchy), inside a private mount namespace where cgroup2 is
 * mounted at /sys/fs/cgroup (contrib/v2node/enter.sh does that part).
 *
 * Why: /proc/<pid>/cgroup lists every hierarchy the kernel has, whatever
 * the mount namespace, and Slurm's cgroup/v2 plugin dies on any line that
 * does not start with "0::" ("fatal: Hybrid mode is not supported. Mounted
 * cgroups are: ..."): 22.05 reads /proc/self/cgroup (_get_self_cg_path),
 * 23.11+ also /proc/1/cgroup (_get_init_cg_path), both in
 * src/plugins/cgroup/v2/cgroup_v2.c. This library answers an open of any
 * /proc/.../cgroup file with a copy that holds only the "0::" line: the
 * cgroup2 path, which is all a pure cgroup v2 node would show.
 *
 * In a cgroup namespace (slurmd in a container, enter.sh with
 * GPUFENCE_V2NODE_CGROUPNS=1) a process outside the namespace's root shows
 * a path that starts with "/.." (e.g. "0::/../../init.scope" for the host's
 * init). 23.11+ takes the directory of /proc/1/cgroup's path for the root
 * of its tree (_get_init_cg_path) and then fails to make its scope in
 * /sys/fs/cgroup/../.. ("Could not create scope directory", seen on
 * 24.11). In a container, pid 1 is the container's init, at the
 * namespace's root: such a path is answered as "0::/", what it would be.
 * Outside a cgroup namespace no path starts with "/..".
 *
 * Test and demo harness only: it never ships in a package, and gpufence
 * itself reads only the "0::" line and needs none of this.
 *
 * Build: cc -shared -fPIC -O2 -o proc-cgroup-v2only.so proc-cgroup-v2only.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

/* "/proc/self/cgroup", "/proc/thread-self/cgroup", "/proc/<n>/cgroup",
 * "/proc/<n>/task/<n>/cgroup". */
static int is_proc_cgroup(const char *p)
{
    size_t n;
    if (!p || strncmp(p, "/proc/", 6) != 0)
        return 0;
    n = strlen(p);
    if (n < 13 || strcmp(p + n - 7, "/cgroup") != 0)
        return 0;
    p += 6;
    if (strncmp(p, "self/", 5) == 0 || strncmp(p, "thread-self/", 12) == 0)
        return strchr(p, '/') == p + n - 6 - 7;
    for (; *p && *p != '/'; p++)
        if (*p < '0' || *p > '9')
            return 0;
    return 1;
}

/* A memfd holding the "0::" lines of the real file, positioned at 0;
 * -1 with errno set when the real file cannot be read. */
static int v2only_fd(int real_fd)
{
    char buf[16384], out[16384];
    ssize_t got, len = 0;
    size_t o = 0;
    int fd, saved;
    char *line, *save = NULL;

    while ((got = read(real_fd, buf + len, sizeof(buf) - 1 - (size_t)len)) > 0)
        len += got;
    saved = errno;
    close(real_fd);
    if (got < 0) {
        errno = saved;
        return -1;
    }
    buf[len] = '\0';
    for (line = strtok_r(buf, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        size_t l;
        if (strncmp(line, "0::", 3) != 0)
            continue;
        /* Outside this cgroup namespace: its root (see the top). */
        if (strcmp(line + 3, "/..") == 0 || strncmp(line + 3, "/../", 4) == 0)
            line[4] = '\0';
        l = strlen(line);
        if (o + l + 1 > sizeof(out))
            continue;
        memcpy(out + o, line, l);
        out[o + l] = '\n';
        o += l + 1;
    }
    fd = (int)syscall(SYS_memfd_create, "proc-cgroup-v2only", MFD_CLOEXEC);
    if (fd < 0)
        return -1;
    if (write(fd, out, o) != (ssize_t)o || lseek(fd, 0, SEEK_SET) != 0) {
        saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

typedef int (*openat_fn)(int, const char *, int, ...);

static int real_openat(int dirfd, const char *path, int flags, mode_t mode)
{
    static openat_fn fn;
    if (!fn)
        fn = (openat_fn)dlsym(RTLD_NEXT, "openat");
    return fn(dirfd, path, flags, mode);
}

static int do_open(int dirfd, const char *path, int flags, mode_t mode)
{
    int fd = real_openat(dirfd, path, flags, mode);
    if (fd < 0 || !is_proc_cgroup(path) || (flags & O_ACCMODE) != O_RDONLY)
        return fd;
    return v2only_fd(fd);
}

static mode_t mode_arg(int flags, va_list ap)
{
    return (flags & (O_CREAT | O_TMPFILE)) ? (mode_t)va_arg(ap, int) : 0;
}

int open(const char *path, int flags, ...)
{
    va_list ap;
    mode_t m;
    va_start(ap, flags);
    m = mode_arg(flags, ap);
    va_end(ap);
    return do_open(AT_FDCWD, path, flags, m);
}

int open64(const char *path, int flags, ...)
{
    va_list ap;
    mode_t m;
    va_start(ap, flags);
    m = mode_arg(flags, ap);
    va_end(ap);
    return do_open(AT_FDCWD, path, flags, m);
}

int openat(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    mode_t m;
    va_start(ap, flags);
    m = mode_arg(flags, ap);
    va_end(ap);
    return do_open(dirfd, path, flags, m);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    mode_t m;
    va_start(ap, flags);
    m = mode_arg(flags, ap);
    va_end(ap);
    return do_open(dirfd, path, flags, m);
}

/* The _FORTIFY_SOURCE entry points. */
int __open_2(const char *path, int flags)
{
    return do_open(AT_FDCWD, path, flags, 0);
}

int __open64_2(const char *path, int flags)
{
    return do_open(AT_FDCWD, path, flags, 0);
}

int __openat_2(int dirfd, const char *path, int flags)
{
    return do_open(dirfd, path, flags, 0);
}

int __openat64_2(int dirfd, const char *path, int flags)
{
    return do_open(dirfd, path, flags, 0);
}

typedef FILE *(*fopen_fn)(const char *, const char *);

static FILE *do_fopen(const char *name, const char *path, const char *how)
{
    static fopen_fn fn;
    int fd;
    FILE *f;
    if (!is_proc_cgroup(path) || !how || how[0] != 'r' || strchr(how, '+')) {
        if (!fn)
            fn = (fopen_fn)dlsym(RTLD_NEXT, name);
        return fn(path, how);
    }
    fd = do_open(AT_FDCWD, path, O_RDONLY | O_CLOEXEC, 0);
    if (fd < 0)
        return NULL;
    f = fdopen(fd, "r");
    if (!f)
        close(fd);
    return f;
}

FILE *fopen(const char *path, const char *how)
{
    return do_fopen("fopen", path, how);
}

FILE *fopen64(const char *path, const char *how)
{
    return do_fopen("fopen64", path, how);
}
