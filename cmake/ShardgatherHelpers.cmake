# Warnings ride on an INTERFACE target linked PRIVATE, so they never leak into consumers.
add_library(shardgather_warnings INTERFACE)
target_compile_options(shardgather_warnings INTERFACE
  "$<$<COMPILE_LANGUAGE:CXX>:-Wall;-Wextra;-Wpedantic;-Wshadow;-Wconversion;-Wsign-conversion;-Wnon-virtual-dtor>"
  # GCC 12 reports std::string concatenation as overlapping memcpy at -O3 (GCC bug 105329):
  # a false positive that breaks Release builds with -Werror.
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<CXX_COMPILER_ID:GNU>>:-Wno-restrict>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${SHARDGATHER_WERROR}>>:-Werror>
  # nvcc: its own warnings and the host compiler's, errors where the C++ ones are.
  "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra>"
  $<$<AND:$<COMPILE_LANGUAGE:CUDA>,$<BOOL:${SHARDGATHER_WERROR}>>:-Werror=all-warnings>)

# shardgather_add_test(NAME target SOURCES ...): a GoogleTest binary, one ctest entry per test.
function(shardgather_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SOURCES;LIBS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_link_libraries(${name} PRIVATE shardgather::shardgather GTest::gtest GTest::gtest_main
                                        shardgather_warnings ${ARG_LIBS})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 120)
  endif()
  # One label naming every group ("unit-threads"): gtest_discover_tests cannot pass a list
  # through PROPERTIES, and ctest -L takes a regex, so -L threads still selects these.
  list(PREPEND ARG_LABELS unit)
  list(JOIN ARG_LABELS "-" labels)
  gtest_discover_tests(${name} PROPERTIES TIMEOUT ${ARG_TIMEOUT} LABELS "${labels}"
                       DISCOVERY_TIMEOUT 60)
endfunction()

# shardgather_add_mpi_test(NAME target NP 1 2 3 4): one ctest entry per rank count, run under
# the launcher FindMPI found. A failure on any rank fails the entry (see tests/mpi/gtest_mpi_main.cc).
function(shardgather_add_mpi_test name)
  cmake_parse_arguments(ARG "" "TARGET;TIMEOUT" "NP" ${ARGN})
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  foreach(np IN LISTS ARG_NP)
    add_test(NAME ${name}_np${np}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${np} ${MPIEXEC_PREFLAGS}
                     $<TARGET_FILE:${ARG_TARGET}> ${MPIEXEC_POSTFLAGS})
    set_tests_properties(${name}_np${np} PROPERTIES PROCESSORS ${np} LABELS mpi
                         TIMEOUT ${ARG_TIMEOUT})
  endforeach()
endfunction()
