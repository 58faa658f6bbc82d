# One image for both parties' web servers and Celery workers (docs/DEPLOYMENT.md: docker compose). The CUDA
# backend comes with a CUDA extra: CuPy and, from its [ctk] extra, the CUDA toolkit's wheels
# (NVRTC among them, which compiles the kernels at start); the NVIDIA driver comes from the host
# through the NVIDIA container toolkit. Without an extra the image runs the CPU backend only.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    MORPHO_VAR_DIR=/app/var \
    MORPHO_MATRIX_PATH=/data/matrix.bin

WORKDIR /app
# Extras of pyproject.toml to install: "cuda13" (CuPy and the CUDA 13 toolkit wheels), "cuda12"
# (the same for CUDA 12, for hosts whose driver predates CUDA 13), or "" (CPU only, no CuPy).
# tests/morphoweb/test_docker_image.py installs the same requirement string into a clean venv.
ARG MORPHO_EXTRAS=""
# Dependencies first, so a code change does not reinstall them.
# The protocol core (pir/) is a distribution of its own that the project requires: installed for good.
COPY pyproject.toml README.md ./
COPY pir pir
RUN mkdir -p gpu_engine morphoweb queries policies epochs engine \
    && touch gpu_engine/__init__.py morphoweb/__init__.py queries/__init__.py policies/__init__.py \
       epochs/__init__.py engine/__init__.py \
    && pip install --no-cache-dir ./pir ".${MORPHO_EXTRAS:+[$MORPHO_EXTRAS]}" \
    && pip uninstall --yes morphoweb \
    && rm -rf gpu_engine morphoweb queries policies epochs engine build morphoweb.egg-info pir
COPY manage.py gunicorn.conf.py ./
COPY gpu_engine gpu_engine
COPY morphoweb morphoweb
COPY queries queries
COPY policies policies
COPY epochs epochs
COPY engine engine
COPY templates templates
COPY bin bin
# The admin's and the API docs' static files, served by WhiteNoise from STATIC_ROOT (/app/staticfiles).
RUN python manage.py collectstatic --no-input -v0

# Every path the image's user writes is made here and owned by it: the state folder, /bulk (a
# party's bulk job files, on a volume its web and worker share), the matrix
# volume's mount point, and /cache, where the engine servers keep CuPy's compiled kernels
# (CUPY_CACHE_DIR=/cache/cupy in docker-compose.yml). A fresh named volume mounted on a path of the
# image takes that path's owner; on a path the image lacks it would be root's, and the first
# kernel compile would fail. tests/morphoweb/test_docker_image.py checks these against docker-compose.yml.
RUN useradd --create-home --uid 1000 morpho \
    && mkdir -p /data /app/var /bulk /cache/cupy \
    && chown morpho /data /app/var /bulk /cache /cache/cupy
USER morpho

EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4).status == 200 else 1)"
# Web processes and threads come from gunicorn.conf.py (MORPHO_WEB_WORKERS, MORPHO_WEB_THREADS).
CMD ["sh", "-c", "python manage.py migrate --no-input && exec gunicorn morphoweb.wsgi --bind 0.0.0.0:8000"]
