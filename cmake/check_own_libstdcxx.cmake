# cmake -DMODULE=path -P check_own_libstdcxx.cmake: warns when a built
# Python extension defines libstdc++'s stream internals itself, i.e. the
# compiler linked its own libstdc++ into it instead of sharing the one
# python and torch load.  Seen on the GPU machine (/opt/gcc's g++ 13.3):
# every number a TORCH_CHECK message streamed died with SIGSEGV inside the
# extension's private copy (its locale never initialised).
find_program(nm_tool nm)
if(NOT nm_tool)
  return()
endif()
execute_process(COMMAND ${nm_tool} -D --defined-only ${MODULE} OUTPUT_VARIABLE syms ERROR_QUIET)
if(syms MATCHES "_ZNSo9_M_insert")
  message(WARNING "${MODULE} holds its own copy of libstdc++'s iostreams (this compiler links libstdc++ "
                  "statically): formatting a number in an error message will crash inside torch.  Build "
                  "loom_torch with the system compiler (cmake -DCMAKE_CXX_COMPILER=/usr/bin/g++).")
endif()
