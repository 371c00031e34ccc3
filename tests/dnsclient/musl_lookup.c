/* musl libc's resolver, as an Alpine-based app has it: `musl_lookup NAME` prints every
 * address getaddrinfo(3) returns, one a line. musl asks every nameserver of
 * /etc/resolv.conf at once over one unconnected UDP socket (IPv6 with v4-mapped
 * addresses when any nameserver is IPv6) and drops replies whose source is not one of
 * them: DNS capture must give the DNS proxy's reply the resolver's address back.
 * Built by tests/dns_capture.rs with musl-gcc (Debian's musl-tools). */
#include <arpa/inet.h>
#include <netdb.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: musl_lookup NAME\n");
        return 2;
    }
    struct addrinfo hints, *res, *ai;
    memset(&hints, 0, sizeof hints);
    hints.ai_socktype = SOCK_STREAM;
    int rc = getaddrinfo(argv[1], NULL, &hints, &res);
    if (rc != 0) {
        fprintf(stderr, "getaddrinfo %s: %s\n", argv[1], gai_strerror(rc));
        return 1;
    }
    for (ai = res; ai; ai = ai->ai_next) {
        char text[INET6_ADDRSTRLEN];
        const void *addr = ai->ai_family == AF_INET
            ? (const void *)&((struct sockaddr_in *)ai->ai_addr)->sin_addr
            : (const void *)&((struct sockaddr_in6 *)ai->ai_addr)->sin6_addr;
        printf("%s\n", inet_ntop(ai->ai_family, addr, text, sizeof text));
    }
    freeaddrinfo(res);
    return 0;
}
