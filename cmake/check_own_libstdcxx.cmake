# cmake -DMODULE=path -P check_own_libstdcxx.cmake: warns when a built
# Python extension defines libstdc++'s stream internals itself, i.e. the
# compiler linked its own (static) libstdc++ into it instead of sharing the
# one python and torch load.  Where the two differ in version, some of the
# copy's symbols bind to the process's library and formatting a number
# crashes: on the GPU machine (/opt/gcc's g++ 13.3) every number a
# TORCH_CHECK message streamed died with SIGSEGV inside the extension.  The
# same static copy with Debian 12's g++, whose version matches, ran fine.
find_program(nm_tool nm)
if(NOT nm_tool)
  return()
endif()
execute_process(COMMAND ${nm_tool} -D --defined-only ${MODULE} OUTPUT_VARIABLE syms ERROR_QUIET)
if(syms MATCHES "_ZNSo9_M_insert")
  message(WARNING "${MODULE} holds its own copy of libstdc++'s iostreams (this compiler links libstdc++ "
                  "statically): where its version differs from the libstdc++ torch loads, formatting a number can crash.  Build "
                  "loom_torch with the system compiler (cmake -DCMAKE_CXX_COMPILER=/usr/bin/g++).")
endif()
