# Makes Horovod 0.28.1 compile its C++ as C++20, which the torch 2.14 headers require (they
# `#error` on anything older). Used by scripts/install_horovod.sh through the CMAKE_TOOLCHAIN_FILE
# environment variable (read by CMake >= 3.21 when configuring a fresh build directory).
#
# Why this detour: Horovod's CMakeLists hard-code `set(CMAKE_CXX_STANDARD 14)` (top level and
# horovod/torch), so CMake adds -std=gnu++14 to every target; CXXFLAGS=-std=c++20 cannot win,
# because Horovod deletes any -std= from CMAKE_CXX_FLAGS. What can be changed is the flag CMake
# emits for "C++14": CMAKE_CXX14_STANDARD_COMPILE_OPTION (and the GNU-extension variant, used
# since CMAKE_CXX_EXTENSIONS defaults to ON).
#
# A toolchain file runs before the compiler is detected, and detection (Compiler/GNU-CXX.cmake)
# sets those two variables afresh, so setting them here alone has no effect. Hence this file also
# registers itself as CMAKE_PROJECT_INCLUDE, which CMake includes at the end of every project()
# call, after detection: on that pass the values below are the ones that stick. Targets that ask
# for another standard (bundled gloo: C++11/17, the CUDA kernels) keep theirs; none of them
# includes torch headers.
set(CMAKE_PROJECT_INCLUDE "${CMAKE_CURRENT_LIST_FILE}")
set(CMAKE_CXX14_STANDARD_COMPILE_OPTION "-std=c++20")
set(CMAKE_CXX14_EXTENSION_COMPILE_OPTION "-std=gnu++20")
