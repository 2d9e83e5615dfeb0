# One image for web, workers, beat and flower (docker-compose.yml picks the command).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY lightning_site lightning_site
COPY store store
COPY runners runners
COPY trainer trainer
COPY examples examples
COPY templates templates
COPY manage.py ./
RUN pip install --no-cache-dir -e .
RUN useradd --create-home lightning && mkdir -p /app/var && chown lightning /app/var
USER lightning
EXPOSE 8000
CMD ["gunicorn", "lightning_site.wsgi:application", "--bind", "0.0.0.0:8000"]
