# Debian 12's xsimd 8.1 exports its target with INTERFACE_LINK_LIBRARIES "xtl" although xsimd 8 does
# not use xtl and the package does not depend on it, so every link line gets a dangling -lxtl.
# When no xtl is installed, an empty imported target of that name absorbs the reference.
if(TARGET xsimd AND NOT TARGET xtl)
  find_package(xtl CONFIG QUIET)
  if(NOT TARGET xtl)
    add_library(xtl INTERFACE IMPORTED)
  endif()
endif()
