/* Compiles include/loom.h as C (C11, -Wall -Wextra -Werror via the build)
 * and checks the basics a C caller sees. */
#include <stdio.h>
#include <string.h>

#include "loom.h"

int main(void) {
  int version = 0;
  if (loomGetVersion(&version) != loomSuccess || version != LOOM_VERSION_CODE) return 1;
  if (strlen(loomGetErrorString(loomInvalidArgument)) == 0) return 1;
  loomComm_t comm = NULL;
  if (loomCommInitRank(&comm, 0, (loomUniqueId){{0}}, 0) != loomInvalidArgument) return 1;
  if (strstr(loomGetLastError(NULL), "nranks") == NULL) return 1;
  /* The config initializer is C too; a config refused names its field. */
  loomConfig_t config = LOOM_CONFIG_INITIALIZER;
  config.deviceKind = 9;
  if (loomCommInitRankConfig(&comm, 2, (loomUniqueId){{0}}, 0, &config) != loomInvalidArgument) return 1;
  if (strstr(loomGetLastError(NULL), "deviceKind 9") == NULL) return 1;
  int count = -1;
  if (loomCudaDeviceCount(&count) != loomSuccess || count < 0) return 1;
  char dump[64];
  if (loomCommDump(NULL, dump, sizeof dump) != loomInvalidArgument) return 1;
  printf("loom.h compiles and links as C; version %d\n", version);
  return 0;
}
