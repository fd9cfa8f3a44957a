# Populates vendor/llama.cpp from the pinned llama-cpp-python sdist and applies our patch series.
#
# llama.cpp is a pinned dependency, not our code: the tree is fetched (pip download is avoided on
# purpose: for an sdist it builds metadata in an isolated env), its sha256 checked, unpacked, and
# every patch in vendor/patches is applied with `git apply`. A patch that does not apply is fatal;
# we never build an unpatched tree. A stamp file records the hash of the series, so a changed
# series is noticed instead of silently building a stale tree.

set(MOETIER_LLAMA_SDIST      "llama_cpp_python-0.3.36.tar.gz")
set(MOETIER_LLAMA_SDIST_SHA  "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")
set(MOETIER_LLAMA_SDIST_URL  "https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/${MOETIER_LLAMA_SDIST}")
set(MOETIER_LLAMA_COMMIT     "0c1e57098")

set(llama_dir   "${CMAKE_CURRENT_SOURCE_DIR}/vendor/llama.cpp")
set(patch_dir   "${CMAKE_CURRENT_SOURCE_DIR}/vendor/patches")
set(stamp_file  "${llama_dir}/.moetier-patches")

file(GLOB moetier_patches "${patch_dir}/*.patch")
list(SORT moetier_patches)
set(series_text "${MOETIER_LLAMA_SDIST_SHA}\n")
foreach(p IN LISTS moetier_patches)
    file(SHA256 "${p}" h)
    get_filename_component(n "${p}" NAME)
    string(APPEND series_text "${n} ${h}\n")
endforeach()
string(SHA256 series_hash "${series_text}")

if (EXISTS "${llama_dir}/CMakeLists.txt")
    if (EXISTS "${stamp_file}")
        file(READ "${stamp_file}" old_hash)
        string(STRIP "${old_hash}" old_hash)
    else()
        set(old_hash "none")
    endif()
    if (NOT old_hash STREQUAL series_hash)
        message(FATAL_ERROR
            "vendor/llama.cpp was prepared with a different patch series (stamp ${old_hash}, series ${series_hash}).\n"
            "Remove vendor/llama.cpp to fetch and patch it again, or, when developing patches, run scripts/llama-patches.sh export.")
    endif()
    return()
endif()

find_package(Git REQUIRED)

set(cache_dir "$ENV{MOETIER_CACHE}")
if (cache_dir STREQUAL "")
    set(cache_dir "$ENV{HOME}/.cache/moetier")
endif()
set(sdist "${cache_dir}/${MOETIER_LLAMA_SDIST}")

if (EXISTS "${sdist}")
    file(SHA256 "${sdist}" have_sha)
    if (NOT have_sha STREQUAL MOETIER_LLAMA_SDIST_SHA)
        message(WARNING "${sdist}: sha256 ${have_sha} does not match the pin; downloading again")
        file(REMOVE "${sdist}")
    endif()
endif()
if (NOT EXISTS "${sdist}")
    message(STATUS "moetier: downloading ${MOETIER_LLAMA_SDIST}")
    file(DOWNLOAD "${MOETIER_LLAMA_SDIST_URL}" "${sdist}.part"
         EXPECTED_HASH SHA256=${MOETIER_LLAMA_SDIST_SHA} STATUS st TLS_VERIFY ON)
    list(GET st 0 code)
    if (NOT code EQUAL 0)
        file(REMOVE "${sdist}.part")
        message(FATAL_ERROR "moetier: downloading ${MOETIER_LLAMA_SDIST_URL} failed: ${st}")
    endif()
    file(RENAME "${sdist}.part" "${sdist}")
endif()

set(work "${CMAKE_CURRENT_SOURCE_DIR}/vendor/.llama.cpp.tmp")
file(REMOVE_RECURSE "${work}")
file(MAKE_DIRECTORY "${work}")
file(ARCHIVE_EXTRACT INPUT "${sdist}" DESTINATION "${work}" PATTERNS "llama_cpp_python-0.3.36/vendor/llama.cpp/*")
set(tree "${work}/llama_cpp_python-0.3.36/vendor/llama.cpp")
# the sdist carries a submodule .git file pointing nowhere; a fresh repo makes `git apply` resolve
# paths against this tree rather than against the enclosing moetier checkout
file(REMOVE "${tree}/.git")
execute_process(COMMAND "${GIT_EXECUTABLE}" init -q WORKING_DIRECTORY "${tree}" RESULT_VARIABLE rc)
foreach(p IN LISTS moetier_patches)
    execute_process(COMMAND "${GIT_EXECUTABLE}" apply --check "${p}" WORKING_DIRECTORY "${tree}"
                    RESULT_VARIABLE rc ERROR_VARIABLE err)
    if (NOT rc EQUAL 0)
        message(FATAL_ERROR "moetier: patch ${p} does not apply to llama.cpp ${MOETIER_LLAMA_COMMIT}:\n${err}")
    endif()
    execute_process(COMMAND "${GIT_EXECUTABLE}" apply "${p}" WORKING_DIRECTORY "${tree}" RESULT_VARIABLE rc)
    if (NOT rc EQUAL 0)
        message(FATAL_ERROR "moetier: applying ${p} failed")
    endif()
    get_filename_component(n "${p}" NAME)
    message(STATUS "moetier: applied ${n}")
endforeach()
file(REMOVE_RECURSE "${tree}/.git")
file(WRITE "${tree}/.moetier-patches" "${series_hash}\n")
file(RENAME "${tree}" "${llama_dir}")
file(REMOVE_RECURSE "${work}")
