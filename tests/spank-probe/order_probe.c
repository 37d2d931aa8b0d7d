/*
 * gpufence-order-probe: a SPANK plugin that opens devices from its own
 * slurm_spank_task_init, as Pyxis starts a container from there, and
 * appends "PATH ok|ENXIO|EPERM|errno N" per device to a file. Listed
 * before gpufence.so in plugstack.conf, it shows that the job's grant is
 * in place before any plugin's task callbacks run, whatever the order
 * (slurmstepd runs every plugin's slurm_spank_init, where gpufence grants,
 * before any task_init: src/common/spank.c, _do_call_stack).
 *
 * plugstack.conf: optional PATH/order_probe.so out=FILE dev=PATH [dev=PATH...]
 * Built by the tests with the Slurm release's own <slurm/spank.h>.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(gpufence_order_probe, 1);

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
    const char *out = NULL;
    int i;
    (void)sp;
    for (i = 0; i < ac; i++)
        if (strncmp(av[i], "out=", 4) == 0)
            out = av[i] + 4;
    if (out == NULL)
        return 0;
    for (i = 0; i < ac; i++) {
        const char *dev;
        int fd, err;
        FILE *f;
        if (strncmp(av[i], "dev=", 4) != 0)
            continue;
        dev = av[i] + 4;
        fd = open(dev, O_RDWR | O_CLOEXEC);
        err = fd < 0 ? errno : 0;
        if (fd >= 0)
            close(fd);
        f = fopen(out, "a");
        if (f == NULL)
            continue;
        if (err == 0)
            fprintf(f, "%s ok\n", dev);
        else if (err == ENXIO)
            fprintf(f, "%s ENXIO\n", dev);
        else if (err == EPERM)
            fprintf(f, "%s EPERM\n", dev);
        else
            fprintf(f, "%s errno %d\n", dev, err);
        fclose(f);
    }
    return 0;
}
