/* A TAP-to-TAP delay line for bench/wan.py: this kernel has no netem, so the one-way delay of the
 * emulated links is applied here, in user space.
 *
 * Each link is a pair of TAP devices, created by this process (non-persistent: they vanish when it
 * exits): PEER (inside a peer's network namespace, its `wan0`) and HUB (inside the hub namespace,
 * enslaved to its bridge by bench/wan.py). Frames the peer's kernel transmits on PEER are written
 * to HUB at once; frames the bridge transmits on HUB (toward the peer) are held DELAY_US
 * microseconds, then written to PEER. A packet between two peers therefore crosses exactly one
 * delay (the receiver's link), and a round trip two: RTT = 2 x DELAY_US.
 *
 * Each held direction is a FIFO with a constant delay, so order is preserved; it holds at most
 * QUEUE_BYTES bytes of frames, beyond which new frames are dropped (and counted), like a router.
 * One thread, ppoll() over every fd with the earliest release time as its timeout. It tries
 * SCHED_FIFO so that a release is not late behind busy peers (it sleeps otherwise); without the
 * permission it stays at the normal policy and says so.
 *
 *   delayline DELAY_US QUEUE_BYTES NETNS_PATH:PEER_IF:NETNS_PATH:HUB_IF [...]
 *
 * Prints "ready sched=POLICY" on stdout once every device exists; on SIGTERM/SIGINT (also sent
 * when its parent dies) prints its counters on stdout ("frames_up N frames_down N bytes_up N
 * bytes_down N dropped N write_errors N": dropped = the queue was full, write_errors = a device
 * refused a frame, e.g. one not up yet) and exits 0.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_LINKS 64
#define FRAME_MAX 65536
#define BATCH 64

struct frame {
    struct frame *next;
    int64_t due_ns;
    size_t len;
    unsigned char data[];
};

struct link {
    int peer_fd, hub_fd;
    struct frame *head, *tail; /* hub -> peer, held */
    size_t queued;
};

static volatile sig_atomic_t stop_flag = 0;
static void on_signal(int sig) { (void)sig; stop_flag = 1; }

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Create TAP `ifname` inside the network namespace at `nspath` (e.g. /run/netns/NAME); the fd
 * stays attached to it after we return to our own namespace. */
static int open_tap(const char *nspath, const char *ifname, int home) {
    int ns = open(nspath, O_RDONLY | O_CLOEXEC);
    if (ns < 0) { fprintf(stderr, "delayline: open %s: %s\n", nspath, strerror(errno)); return -1; }
    if (setns(ns, CLONE_NEWNET) < 0) {
        fprintf(stderr, "delayline: setns %s: %s\n", nspath, strerror(errno)); close(ns); return -1;
    }
    close(ns);
    int fd = open("/dev/net/tun", O_RDWR | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) { fprintf(stderr, "delayline: open /dev/net/tun: %s\n", strerror(errno)); return -1; }
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    strncpy(ifr.ifr_name, ifname, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0) {
        fprintf(stderr, "delayline: TUNSETIFF %s in %s: %s\n", ifname, nspath, strerror(errno)); close(fd); return -1;
    }
    if (setns(home, CLONE_NEWNET) < 0) { fprintf(stderr, "delayline: setns back: %s\n", strerror(errno)); return -1; }
    return fd;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: delayline DELAY_US QUEUE_BYTES NETNS:PEER_IF:NETNS:HUB_IF [...]\n");
        return 2;
    }
    int64_t delay_ns = atoll(argv[1]) * 1000LL;
    size_t cap = (size_t)atoll(argv[2]);
    int n = argc - 3;
    if (delay_ns < 0 || cap < FRAME_MAX || n > MAX_LINKS) { fprintf(stderr, "delayline: bad arguments\n"); return 2; }
    int home = open("/proc/self/ns/net", O_RDONLY | O_CLOEXEC);
    if (home < 0) { perror("delayline: /proc/self/ns/net"); return 1; }
    static struct link links[MAX_LINKS];
    for (int i = 0; i < n; i++) {
        char *spec = strdup(argv[3 + i]);
        char *f[4];
        for (int k = 0; k < 4; k++) f[k] = strsep(&spec, ":");
        if (!f[3]) { fprintf(stderr, "delayline: bad link %s\n", argv[3 + i]); return 2; }
        links[i].peer_fd = open_tap(f[0], f[1], home);
        links[i].hub_fd = open_tap(f[2], f[3], home);
        if (links[i].peer_fd < 0 || links[i].hub_fd < 0) return 1;
    }
    struct sched_param sp = {.sched_priority = 10};
    const char *policy = sched_setscheduler(0, SCHED_FIFO, &sp) == 0 ? "fifo" : "other";
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    prctl(PR_SET_PDEATHSIG, SIGTERM); /* bench/wan.py died: go, and take the devices with us */
    if (getppid() == 1) return 0;
    printf("ready sched=%s\n", policy);
    fflush(stdout);

    struct pollfd pfd[2 * MAX_LINKS];
    for (int i = 0; i < n; i++) {
        pfd[2 * i] = (struct pollfd){.fd = links[i].peer_fd, .events = POLLIN};
        pfd[2 * i + 1] = (struct pollfd){.fd = links[i].hub_fd, .events = POLLIN};
    }
    unsigned long long frames_up = 0, frames_down = 0, bytes_up = 0, bytes_down = 0, dropped = 0, write_errors = 0;
    static unsigned char buf[FRAME_MAX];
    while (!stop_flag) {
        /* release what is due; the earliest pending release bounds the wait */
        int64_t t = now_ns(), next = -1;
        for (int i = 0; i < n; i++) {
            struct link *L = &links[i];
            while (L->head && L->head->due_ns <= t) {
                struct frame *fr = L->head;
                if (write(L->peer_fd, fr->data, fr->len) < 0) write_errors++;
                else { frames_down++; bytes_down += fr->len; }
                L->head = fr->next;
                if (!L->head) L->tail = NULL;
                L->queued -= fr->len;
                free(fr);
            }
            if (L->head && (next < 0 || L->head->due_ns < next)) next = L->head->due_ns;
        }
        struct timespec ts, *tp = NULL;
        if (next >= 0) {
            int64_t w = next - now_ns();
            if (w < 0) w = 0;
            ts.tv_sec = w / 1000000000LL;
            ts.tv_nsec = w % 1000000000LL;
            tp = &ts;
        }
        int r = ppoll(pfd, 2 * n, tp, NULL);
        if (r < 0) {
            if (errno == EINTR) continue;
            perror("delayline: ppoll");
            return 1;
        }
        if (r == 0) continue;
        for (int i = 0; i < n; i++) {
            struct link *L = &links[i];
            if (pfd[2 * i].revents & POLLIN) { /* peer -> hub: at once */
                for (int b = 0; b < BATCH; b++) {
                    ssize_t len = read(L->peer_fd, buf, sizeof buf);
                    if (len <= 0) break;
                    if (write(L->hub_fd, buf, (size_t)len) < 0) write_errors++;
                    else { frames_up++; bytes_up += (unsigned long long)len; }
                }
            }
            if (pfd[2 * i + 1].revents & POLLIN) { /* hub -> peer: held */
                int64_t arrived = now_ns();
                for (int b = 0; b < BATCH; b++) {
                    ssize_t len = read(L->hub_fd, buf, sizeof buf);
                    if (len <= 0) break;
                    if (delay_ns == 0) {
                        if (write(L->peer_fd, buf, (size_t)len) < 0) write_errors++;
                        else { frames_down++; bytes_down += (unsigned long long)len; }
                        continue;
                    }
                    if (L->queued + (size_t)len > cap) { dropped++; continue; }
                    struct frame *fr = malloc(sizeof *fr + (size_t)len);
                    if (!fr) { dropped++; continue; }
                    fr->next = NULL;
                    fr->due_ns = arrived + delay_ns;
                    fr->len = (size_t)len;
                    memcpy(fr->data, buf, (size_t)len);
                    if (L->tail) L->tail->next = fr; else L->head = fr;
                    L->tail = fr;
                    L->queued += (size_t)len;
                }
            }
            if ((pfd[2 * i].revents | pfd[2 * i + 1].revents) & (POLLERR | POLLHUP | POLLNVAL)) {
                fprintf(stderr, "delayline: link %d: device error\n", i);
                return 1;
            }
        }
    }
    printf("frames_up %llu frames_down %llu bytes_up %llu bytes_down %llu dropped %llu write_errors %llu\n",
           frames_up, frames_down, bytes_up, bytes_down, dropped, write_errors);
    fflush(stdout);
    return 0;
}
