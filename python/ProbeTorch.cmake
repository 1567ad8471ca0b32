# Finds what the Python binding needs, building nothing: the interpreter (the presets pin
# .venv/bin/python, made by tools/install-deps) and the torch installed for it. pybind11 is the
# copy torch ships in its include directory: the module must be built with torch's own pybind11
# (same internals version and ABI tags) to share its type registry and accept ProcessGroups.
# Torch is located by asking the interpreter rather than through TorchConfig.cmake: Debian's
# config drags in Caffe2's whole dependency set and pip wheels ship a different one, while torch
# itself reports its include and library directories and ABI flags the same way in 1.13 and 2.x.
# Sets SHARDGATHER_PYTHON_DEPS_FOUND and, when found, SHARDGATHER_TORCH_VERSION,
# SHARDGATHER_TORCH_INCLUDE_DIRS, SHARDGATHER_TORCH_LIBRARY_DIR, SHARDGATHER_TORCH_CXX11_ABI and
# SHARDGATHER_TORCH_PYBIND11_DEFINES (the pybind11 ABI tags torch was built with, so that our
# module shares pybind11's type registry with torch and can accept its ProcessGroup objects).
set(SHARDGATHER_PYTHON_DEPS_FOUND OFF)
find_package(Python 3 QUIET COMPONENTS Interpreter Development.Module)
if(Python_FOUND)
  # One value per line; lists inside a line are comma-separated.
  execute_process(
    COMMAND ${Python_EXECUTABLE} -c [=[
import os, torch
base = os.path.dirname(torch.__file__)
inc = os.path.join(base, "include")
print(torch.__version__.split("+")[0])
print(",".join([inc, os.path.join(inc, "torch", "csrc", "api", "include")]))
print(os.path.join(base, "lib"))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(",".join("%s=\"%s\"" % (k, getattr(torch._C, "_" + k)) for k in
               ("PYBIND11_COMPILER_TYPE", "PYBIND11_STDLIB", "PYBIND11_BUILD_ABI")
               if getattr(torch._C, "_" + k, None) is not None) or "-")
]=]
    OUTPUT_VARIABLE _sg_out ERROR_QUIET RESULT_VARIABLE _sg_rc OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(_sg_rc EQUAL 0)
    string(REGEX MATCHALL "[^\n]+" _sg_lines "${_sg_out}")
    list(LENGTH _sg_lines _sg_n)
    set(_sg_inc_first "")
    if(_sg_n EQUAL 5)
      list(GET _sg_lines 1 _sg_inc_all)
      string(REGEX REPLACE ",.*" "" _sg_inc_first "${_sg_inc_all}")
    endif()
    if(_sg_n EQUAL 5 AND EXISTS "${_sg_inc_first}/pybind11/pybind11.h")
      list(GET _sg_lines 0 SHARDGATHER_TORCH_VERSION)
      list(GET _sg_lines 1 _sg_inc)
      string(REPLACE "," ";" SHARDGATHER_TORCH_INCLUDE_DIRS "${_sg_inc}")
      list(GET _sg_lines 2 SHARDGATHER_TORCH_LIBRARY_DIR)
      list(GET _sg_lines 3 SHARDGATHER_TORCH_CXX11_ABI)
      list(GET _sg_lines 4 _sg_defs)
      set(SHARDGATHER_TORCH_PYBIND11_DEFINES "")
      if(NOT _sg_defs STREQUAL "-")
        string(REPLACE "," ";" SHARDGATHER_TORCH_PYBIND11_DEFINES "${_sg_defs}")
      endif()
      set(SHARDGATHER_PYTHON_DEPS_FOUND ON)
    endif()
  endif()
endif()
