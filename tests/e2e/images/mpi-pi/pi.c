/* The MPI "hello world" of Kubeflow's MPI Operator examples: every rank integrates a share of
 * 4/(1+x^2) over [0,1], rank 0 prints the sum (pi). Each rank also says where it runs and as
 * which user, so a test can see the ranks were spread over the workers as the image's user. */
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>

int main(int argc, char **argv) {
    int rank, size, len;
    char host[MPI_MAX_PROCESSOR_NAME];
    const long steps = 10000000;
    double sum = 0.0, pi = 0.0;

    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    MPI_Get_processor_name(host, &len);
    for (long i = rank; i < steps; i += size) {
        double x = (i + 0.5) / steps;
        sum += 4.0 / (1.0 + x * x);
    }
    sum /= steps;
    MPI_Reduce(&sum, &pi, 1, MPI_DOUBLE, MPI_SUM, 0, MPI_COMM_WORLD);
    printf("rank %d/%d on %s as uid %d\n", rank, size, host, (int)getuid());
    fflush(stdout);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {
        printf("pi is approximately %.10f\n", pi);
    }
    MPI_Finalize();
    return 0;
}
