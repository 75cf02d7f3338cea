/*
 * The pod sandbox ("pause") process for the dev cluster's containerd (sandbox_image): it holds the
 * pod's namespaces open and does nothing else. Same behaviour as Kubernetes' own
 * build/pause/linux/pause.c: sleep in pause(2) forever, exit 0 on SIGINT/SIGTERM, and, as PID 1
 * of a pod that shares its PID namespace, reap every child that gets reparented to it.
 * Built statically (gcc -static) into an image FROM scratch by trainop.devcluster.images.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define VERSION "trainop-pause 1.0"

static void sigdown(int signo) {
    psignal(signo, "Shutting down, got signal");
    exit(0);
}

static void sigreap(int signo) {
    (void)signo;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(int argc, char **argv) {
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "-v") == 0) {
            printf("%s\n", VERSION);
            return 0;
        }
    }
    if (getpid() != 1) {
        /* Not an error: only PID 1 inherits orphans, so reaping is then moot. */
        fprintf(stderr, "Warning: pause should be the first process\n");
    }

    struct sigaction down = {.sa_handler = sigdown};
    struct sigaction reap = {.sa_handler = sigreap, .sa_flags = SA_NOCLDSTOP};
    if (sigaction(SIGINT, &down, NULL) < 0) return 1;
    if (sigaction(SIGTERM, &down, NULL) < 0) return 2;
    if (sigaction(SIGCHLD, &reap, NULL) < 0) return 3;

    for (;;) {
        pause();
    }
    fprintf(stderr, "Error: infinite loop terminated\n");
    return 42;
}
